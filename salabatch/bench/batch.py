"""The Batch API under load: one batch of `lines` chat requests over `documents` documents (each
document in the system message of `lines / documents` lines, the lines of the documents
interleaved) through a `salabatch serve` process, and interactive chat requests meanwhile.

Reported: how many lines prefilled their document (usage: no cached tokens) per document, that
every custom_id came back once, the batch's time, and the time to first token of streamed chat
requests on the idle server against while the batch runs.
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
import uuid
from collections import Counter

from salabatch.bench.serve import DEMO, QUESTIONS, _server, _stream


def run(
    model_ref: str = "builtin:random",
    *,
    lines: int = 200,
    documents: int = 10,
    max_tokens: int = 16,
    chats: int = 5,
    progress=print,
) -> dict:
    text = (DEMO / "docs" / "rivercrest-labs-long.txt").read_text()
    docs = [f"Document {d}.\n{text}" for d in range(documents)]
    requests = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "salabatch",
                "messages": [
                    {"role": "system", "content": docs[i % documents]},
                    {"role": "user", "content": QUESTIONS[(i // documents) % len(QUESTIONS)]},
                ],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i in range(lines)
    ]
    chat = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a colour."},
    ]
    with _server(model_ref, batch_size=8) as (url, _):
        progress("chat on the idle server …")
        idle = [_stream(url, chat, max_tokens)[0] for _ in range(chats)]
        file_id = _upload(url, "".join(json.dumps(r) + "\n" for r in requests).encode())
        start = time.perf_counter()
        batch = _post(url, "/batches", {
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        })  # fmt: skip
        progress(f"a {lines}-line batch over {documents} documents, chat meanwhile …")
        busy = []
        while True:
            batch = _get(url, f"/batches/{batch['id']}")
            if batch["status"] in ("completed", "failed", "cancelled", "expired"):
                break
            if batch["status"] == "in_progress" and len(busy) < chats:
                busy.append(_stream(url, chat, max_tokens)[0])
            time.sleep(0.2)
        seconds = time.perf_counter() - start
        if batch["status"] != "completed":
            raise RuntimeError(f"the bench's batch ended {batch['status']}: {batch.get('errors')}")
        output = _content(url, batch["output_file_id"])
    rows = [json.loads(line) for line in output.splitlines() if line.strip()]
    ids = Counter(r["custom_id"] for r in rows)
    prefilled = Counter()  # per document: lines that prefilled it (no cached tokens)
    for r in rows:
        usage = r["response"]["body"]["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        prefilled[int(r["custom_id"].split("-")[1]) % documents] += cached == 0
    return {
        "model": model_ref,
        "lines": lines,
        "documents": documents,
        "max_tokens": max_tokens,
        "batch_s": round(seconds, 2),
        "lines_back": len(rows),
        "every_line_once": len(ids) == lines and set(ids.values()) == {1},
        "prefills_per_document": [prefilled[d] for d in range(documents)],
        "request_counts": batch["request_counts"],
        "chat_ttft_idle_s": [round(t, 3) for t in idle],
        "chat_ttft_busy_s": [round(t, 3) for t in busy],
        "chat_ttft_ratio": round(statistics.median(busy) / statistics.median(idle), 2)
        if busy
        else None,
    }


def table(result: dict) -> str:
    return "\n".join(
        [
            f"{result['lines']} lines over {result['documents']} documents: {result['batch_s']} s, "
            f"{result['lines_back']} lines back, every line once: {result['every_line_once']}",
            f"lines that prefilled their document, per document: {result['prefills_per_document']}",
            f"chat TTFT idle {result['chat_ttft_idle_s']} s, during the batch "
            f"{result['chat_ttft_busy_s']} s: median ratio {result['chat_ttft_ratio']}",
        ]
    )


def _request(url: str, path: str, data: bytes | None = None, headers: dict | None = None):
    req = urllib.request.Request(f"{url}{path}", data, headers or {})
    return urllib.request.urlopen(req, timeout=600)


def _get(url: str, path: str) -> dict:
    with _request(url, path) as response:
        return json.load(response)


def _post(url: str, path: str, body: dict) -> dict:
    data = json.dumps(body).encode()
    with _request(url, path, data, {"Content-Type": "application/json"}) as response:
        return json.load(response)


def _content(url: str, file_id: str) -> str:
    with _request(url, f"/files/{file_id}/content") as response:
        return response.read().decode()


def _upload(url: str, content: bytes) -> str:
    """POST /v1/files, multipart as a client sends it → the file's id."""
    boundary = uuid.uuid4().hex
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode(),
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="batch.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n".encode(),
        content,
        f"\r\n--{boundary}--\r\n".encode(),
    ]
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    with _request(url, "/files", b"".join(parts), headers) as response:
        return json.load(response)["id"]
