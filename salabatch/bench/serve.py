"""What the server's continuous batching buys: the same questions over one document, answered
three ways in one run, each with the document already prefilled (a server that has served it
once; a job whose document is in the prefix store), so that the questions' own work is compared:

* concurrent: `clients` streaming OpenAI clients at once against `salabatch serve`'s app
  (uvicorn on 127.0.0.1, a free port): the document is their shared system message, and their
  rows decode as one batch;
* one_at_a_time: the same requests, each sent when the last has finished;
* run: the same questions as a `salabatch run` job over the same prefix store.

The two served modes share one server and alternate, round by round (ROUNDS each, which
comes first switching every round), so that the machine's drift falls on both alike; each
mode's median round is reported, and the ratio of concurrent over one at a time is the median
of the rounds' pairs (this machine's neighbours move single rounds by a third). `run` is timed
in ROUNDS rounds of its own.

The default model is `builtin:random` (untrained: its answers run to `max_tokens`, so decoding
is measured, where the trained demo model stops after a few tokens).

Reported: total completion tokens per second of each, time to first token (p50, p95) of the
server's requests, and the ratios. With `turn_tokens`, a conversation's second turn over a
document that long, and questions and lm-eval-style scored choices after it where nothing marks
it off (`unmarked`): what the later ones prefill. `soak` more requests cycling through
`soak_documents` documents with a small prefix-memory cap measure the server's RSS over time
instead.
"""

from __future__ import annotations

import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import yaml

DEMO = Path(__file__).resolve().parents[2] / "jobs" / "demo"
ROUNDS = 5  # timed rounds of each mode; the median is reported
QUESTIONS = [
    "Give the service provider of this agreement.",
    "Tell me the Client in the contract.",
    "What is the total fee under the agreement?",
    "Find the commencement date.",
    "Look up the initial term of this agreement.",
    "Report the governing law in the contract.",
    "I need the payment period stated in the document.",
    "Name the party that pays the fee.",
]


def run(
    model_ref: str = "builtin:random",
    *,
    clients: int = 8,
    max_tokens: int = 64,
    document: Path | None = None,
    soak: int = 0,
    soak_documents: int = 20,
    soak_prefix_mb: float = 16.0,
    turn_tokens: int = 16384,
    progress=print,
) -> dict:
    from salabatch.engine.tokenizer import load_tokenizer
    from salabatch.models import resolve_model

    tok = load_tokenizer(resolve_model(model_ref))
    text = document_text(document or DEMO / "docs" / "rivercrest-labs-long.txt")
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(clients)]
    out: dict = {
        "model": model_ref,
        "clients": clients,
        "max_tokens": max_tokens,
        "document_tokens": len(tok.encode(text)),
    }
    progress(f"{clients} concurrent clients and the same requests one at a time, alternating …")
    served, paired = _served(model_ref, text, questions, max_tokens)
    out.update(served)
    progress("the same questions through salabatch run …")
    out["run"] = _run_job(model_ref, text, questions, max_tokens, clients)
    out["ratios"] = {
        "concurrent_over_one_at_a_time": round(statistics.median(paired), 2),
        "concurrent_over_one_at_a_time_rounds": [round(r, 2) for r in paired],
        "concurrent_over_run": round(
            out["concurrent"]["tokens_per_s"] / out["run"]["tokens_per_s"], 2
        ),
    }
    if turn_tokens:
        progress(f"a second turn over a {turn_tokens}-token document …")
        out["turns"] = _turns(model_ref, tok, text, turn_tokens, max_tokens)
        progress("questions and scored choices after it, nothing marking it off …")
        out["unmarked"] = _unmarked(model_ref, tok, text, turn_tokens, max_tokens)
    if soak:
        progress(f"soak: {soak} requests over {soak_documents} documents …")
        out["soak"] = _soak(model_ref, tok, text, soak, soak_documents, max_tokens, soak_prefix_mb)
    return out


def _served(model_ref, text, questions, max_tokens) -> tuple[dict, list[float]]:
    """({"concurrent": ..., "one_at_a_time": ...}, each round's concurrent over one at a time
    tokens/s) from one server, the modes alternating."""
    rounds: dict[str, list] = {"concurrent": [], "one_at_a_time": []}
    with _server(model_ref, batch_size=max(8, len(questions))) as (url, _):

        def ask(question: str) -> tuple[float, int, int]:
            messages = [
                {"role": "system", "content": text},
                {"role": "user", "content": question},
            ]
            return _stream(url, messages, max_tokens)

        ask("Summarize the document.")  # the document prefilled and held, as on a busy server
        for i in range(ROUNDS):
            for mode in list(rounds)[:: 1 if i % 2 == 0 else -1]:
                start = time.perf_counter()
                if mode == "concurrent":
                    with ThreadPoolExecutor(len(questions)) as pool:
                        answers = list(pool.map(ask, questions))
                else:
                    answers = [ask(q) for q in questions]
                rounds[mode].append((time.perf_counter() - start, answers))

    def rate(r) -> float:  # a round's completion tokens per second
        seconds, answers = r
        return sum(a[1] for a in answers) / seconds

    paired = [
        rate(c) / rate(o)
        for c, o in zip(rounds["concurrent"], rounds["one_at_a_time"], strict=True)
    ]
    return {mode: _summary(r) for mode, r in rounds.items()}, paired


def _summary(rounds: list) -> dict:
    """A served mode's figures from its rounds [(seconds, answers)]: the median round's."""
    seconds, answers = sorted(rounds, key=lambda r: r[0])[len(rounds) // 2]
    ttft = sorted(a[0] for a in answers)
    tokens = sum(a[1] for a in answers)
    return {
        "seconds": round(seconds, 3),
        "rounds_s": [round(r[0], 3) for r in rounds],
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "ttft_p50_s": round(statistics.median(ttft), 3),
        "ttft_p95_s": round(ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))], 3),
        "cached_tokens": sum(a[2] for a in answers),
    }


def _run_job(model_ref, text, questions, max_tokens, batch) -> dict:
    import pyarrow.parquet as pq

    from salabatch.jobs.run.runner import run_job
    from salabatch.jobs.spec.load import load_job

    with tempfile.TemporaryDirectory() as root:
        docs = Path(root, "docs")
        docs.mkdir()
        (docs / "document.txt").write_text(text)
        job = {
            "name": "bench-serve",
            "model": model_ref,
            "documents": [{"path": "./docs"}],
            "questions": [{"id": f"q{i}", "text": q} for i, q in enumerate(questions)],
            "generation": {"max_tokens": max_tokens, "temperature": 0.0, "think": False},
            "engine": {"batch_size": batch},
            "cache": {"dir": "./store"},
            "output": {"path": "./warm.parquet"},
        }
        path = Path(root, "job.yaml")
        warm = {**job, "questions": [{"id": "warm", "text": "Summarize the document."}]}
        path.write_text(yaml.safe_dump(warm))  # the document prefilled into the store
        run_job(load_job(path), progress=False, echo=lambda _: None)
        rounds = []
        for i in range(ROUNDS):  # each a new run over the store: the document from disk
            out = f"./answers-{i}.parquet"
            path.write_text(yaml.safe_dump({**job, "output": {"path": out}}))
            summary = run_job(load_job(path), progress=False, echo=lambda _: None)
            table = pq.read_table(Path(root, out)).to_pylist()
            if summary.errors or len(table) != len(questions):
                raise RuntimeError(f"the bench's salabatch run failed: {summary}")
            rounds.append((summary.seconds, sum(r["completion_tokens"] for r in table)))
    seconds, tokens = sorted(rounds)[len(rounds) // 2]
    return {
        "seconds": round(seconds, 3),
        "rounds_s": [round(r[0], 3) for r in rounds],
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
    }


def document_text(path: Path) -> str:
    """The text of the benchmark's document, read as `salabatch run` reads it (a PDF's
    included); ValueError saying why where there is none (an empty or unreadable file)."""
    from salabatch.jobs.ingest.documents import DocumentSource, iter_documents

    docs = list(iter_documents([DocumentSource(path)]))
    if len(docs) != 1:
        raise ValueError(f"holds {len(docs)} documents (a .jsonl file's records): give one")
    if not docs[0].ok or not docs[0].text.strip():
        raise ValueError(docs[0].error or "no text")
    return docs[0].text


def _sized(tok, text: str, tokens: int) -> str:
    """A document of about `tokens` tokens: `text` repeated, or its first tokens' text."""
    ids = tok.encode(text)
    if len(ids) >= tokens:
        return tok.decode(ids[:tokens])
    return "\n\n".join([text] * round(tokens / len(ids)))


def _turns(model_ref, tok, text, tokens, max_tokens) -> dict:
    """Two turns of one conversation over a document of about `tokens` tokens (the document
    repeated): what the second prefills, by its usage."""
    document = _sized(tok, text, tokens)
    messages = [{"role": "system", "content": document}, {"role": "user", "content": QUESTIONS[0]}]
    with _server(model_ref, batch_size=8) as (url, _):
        usage = []
        for question in QUESTIONS[1:3]:
            start = time.perf_counter()
            reply = _post(url, messages, max_tokens)
            u = reply["usage"]
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            usage.append((u["prompt_tokens"], cached, time.perf_counter() - start))
            answer = reply["choices"][0]["message"]["content"] or ""
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": question},
            ]
    (p1, c1, s1), (p2, c2, s2) = usage
    return {
        "turn1_prompt_tokens": p1,
        "turn1_cached_tokens": c1,
        "turn1_s": round(s1, 2),
        "turn2_prompt_tokens": p2,
        "turn2_cached_tokens": c2,
        "turn2_s": round(s2, 2),
        "turn2_prefilled_share_of_turn1": round((p2 - c2) / p1, 4),
    }


def _unmarked(model_ref, tok, text, tokens, max_tokens) -> dict:
    """A document of about `tokens` tokens that no message boundary marks off, on a fresh
    server: three chat requests with it in the user message before a question, then three
    completions scoring it with a choice after it (`echo`, `logprobs: 1`, `max_tokens: 0`: an
    lm-eval loglikelihood). What each prefilled, by its usage: the first of each kind all of
    it, the next ones their last tokens (they resume before the first's tail)."""
    document = _sized(tok, text, tokens)
    out: dict = {}
    with _server(model_ref, batch_size=8) as (url, _):
        asked = []
        for question in QUESTIONS[:3]:
            messages = [{"role": "user", "content": f"{document}\n\n{question}"}]
            start = time.perf_counter()
            u = _post(url, messages, max_tokens)["usage"]
            asked.append((u, time.perf_counter() - start))
        scored = []
        for choice in (" Acme", " Bolt", " Rivercrest"):
            body = {"prompt": document + "\nThe provider is" + choice, "max_tokens": 0}
            start = time.perf_counter()
            u = _complete(url, body | {"echo": True, "logprobs": 1})["usage"]
            scored.append((u, time.perf_counter() - start))
    for name, got in (("questions", asked), ("choices", scored)):
        first = got[0][0]["prompt_tokens"]
        cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u, _ in got]
        prefilled = [u["prompt_tokens"] - c for (u, _), c in zip(got, cached, strict=True)]
        out[name] = {
            "prompt_tokens": [u["prompt_tokens"] for u, _ in got],
            "cached_tokens": cached,
            "seconds": [round(t, 2) for _, t in got],
            "later_prefilled_share_of_first": round(max(prefilled[1:]) / first, 4),
        }
    return out


def _soak(model_ref, tok, text, requests, documents, max_tokens, cap_mb) -> dict:
    """Requests cycling through `documents` variants of the document (each its own prefix) on
    a server whose prefix memory (`cap_mb`) holds only some of them, the rest going to its
    prefix store on disk: the server's RSS sampled every 50 requests and after the last."""
    variants = [f"Document {i}.\n{text}" for i in range(documents)]
    one = len(tok.encode(variants[0]))
    with _server(model_ref, batch_size=8, prefix_gb=cap_mb / 1024) as (url, pid):
        rss = []
        start = time.perf_counter()
        for i in range(requests):
            messages = [
                {"role": "system", "content": variants[i % documents]},
                {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
            ]
            _post(url, messages, max_tokens)
            if (i + 1) % 50 == 0 or i + 1 == requests:  # and after the last: a short soak
                rss.append(round(_rss_gb(pid), 3))
        seconds = time.perf_counter() - start
        metrics = _metrics(url)
    settled = rss[len(rss) // 5 :] or rss  # after the first fifth: buffers reach their sizes
    return {
        "requests": requests,
        "documents": documents,
        "document_tokens": one,
        "prefix_memory_mb": cap_mb,
        "seconds": round(seconds, 1),
        "rss_gb_every_50": rss,
        "rss_spread": round((max(settled) - min(settled)) / min(settled), 3),
        "server": metrics,  # what the server's prefix memory did, from its /metrics
    }


def _metrics(url: str) -> dict[str, float]:
    """The server's prefix counters and gauges from /metrics (Prometheus text)."""
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=60) as response:
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("salabatch_prefix") or name.startswith("salabatch_requests"):
            out[name.removeprefix("salabatch_")] = float(value)
    return out


def _body(messages: list[dict], max_tokens: int, stream: bool) -> bytes:
    body = {"model": "salabatch", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body).encode()


def _open(url: str, body: bytes, route: str = "chat/completions"):
    request = urllib.request.Request(f"{url}/{route}", body, {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=3600)


def _complete(url: str, body: dict) -> dict:
    """A text completion (`body` without the model), whole."""
    data = json.dumps({"model": "salabatch", "temperature": 0} | body).encode()
    with _open(url, data, "completions") as response:
        return json.load(response)


def _post(url: str, messages: list[dict], max_tokens: int) -> dict:
    """A chat completion, whole."""
    with _open(url, _body(messages, max_tokens, stream=False)) as response:
        return json.load(response)


def _stream(url: str, messages: list[dict], max_tokens: int) -> tuple[float, int, int]:
    """A streamed chat completion, read as a client reads it (a plain SSE reader: the clients
    share this 2-core machine with the server, so they should cost it little) → (seconds to
    the first content, completion tokens, cached prompt tokens)."""
    start = time.perf_counter()
    first, usage = None, None
    with _open(url, _body(messages, max_tokens, stream=True)) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the bench's request failed: {chunk['error']}")
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return first or time.perf_counter() - start, usage["completion_tokens"], cached


def _rss_gb(pid: int) -> float:
    """The resident memory of process `pid` now, in GB (Linux /proc; elsewhere `ps`)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip() or 0) / 2**20


@contextmanager
def _server(model_ref: str, *, batch_size: int, prefix_gb: float = 2.0):
    """`salabatch serve` as a process of its own (its engine thread and event loop share no
    interpreter with the clients, as in use), on 127.0.0.1 and a free port, over a fresh prefix
    store; yields (base URL, its pid)."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as store:
        command = [
            sys.executable, "-m", "salabatch.cli", "serve", "--model", model_ref,
            "--host", "127.0.0.1", "--port", str(port), "--batch-size", str(batch_size),
            "--max-queue", "256", "--state-dir", store, "--prefix-memory", str(prefix_gb),
            "--served-model-name", "salabatch",
        ]  # fmt: skip
        with Path(store, "server.log").open("w+b") as log:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
            try:
                _wait_for(port, process, log)
                yield f"http://127.0.0.1:{port}/v1", process.pid
            finally:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _wait_for(port: int, process: subprocess.Popen, log) -> None:
    """Until the server at `port` answers /health (two minutes at most)."""
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            log.seek(0)
            why = log.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"the bench's server stopped: {why}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("the bench's server did not start in 120 s") from None
            time.sleep(0.2)


def table(result: dict) -> str:
    rows = [("mode", "seconds", "tokens", "tok/s", "TTFT p50", "TTFT p95")]
    for mode in ("concurrent", "one_at_a_time", "run"):
        r = result[mode]
        rows.append(
            (
                mode,
                f"{r['seconds']:.2f}",
                str(r["completion_tokens"]),
                f"{r['tokens_per_s']:.1f}",
                f"{r['ttft_p50_s']:.3f}" if "ttft_p50_s" in r else "–",
                f"{r['ttft_p95_s']:.3f}" if "ttft_p95_s" in r else "–",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    ratios = result["ratios"]
    pairs = ", ".join(f"{r:.2f}" for r in ratios["concurrent_over_one_at_a_time_rounds"])
    lines.append(
        f"concurrent / one at a time: {ratios['concurrent_over_one_at_a_time']:.2f}x (median of "
        f"the rounds' pairs: {pairs}); concurrent / salabatch run: "
        f"{ratios['concurrent_over_run']:.2f}x"
    )
    if "turns" in result:
        t = result["turns"]
        lines.append(
            f"second turn: {t['turn2_prompt_tokens']} prompt tokens, {t['turn2_cached_tokens']} "
            f"cached: prefilled {100 * t['turn2_prefilled_share_of_turn1']:.2f} % of the first "
            f"turn's {t['turn1_prompt_tokens']} ({t['turn2_s']} s against {t['turn1_s']} s)"
        )
    for name, what in (("questions", "questions"), ("choices", "scored choices")):
        u = result.get("unmarked", {}).get(name)
        if u:
            lines.append(
                f"{what} after an unmarked {u['prompt_tokens'][0]}-token prompt: the later ones "
                f"prefilled at most {100 * u['later_prefilled_share_of_first']:.2f} % of the "
                f"first's (cached {u['cached_tokens']}; {u['seconds']} s)"
            )
    if "soak" in result:
        s = result["soak"]
        lines.append(
            f"soak: {s['requests']} requests over {s['documents']} documents, RSS (GB, every 50) "
            f"{s['rss_gb_every_50']}, spread after warm-up {100 * s['rss_spread']:.1f} %"
        )
    return "\n".join(lines)


def chart(result: dict, path: str) -> None:
    """Total tokens/s of the three modes, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ("concurrent", "one_at_a_time", "run")
    labels = (f"{result['clients']} concurrent clients", "one at a time", "salabatch run")
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(labels, [result[m]["tokens_per_s"] for m in modes], color=["C0", "C7", "C2"])
    ax.set_ylabel("completion tokens/s (total)")
    ax.set_title(f"salabatch bench serve — {result['model']}, {result['document_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
