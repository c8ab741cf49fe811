"""The stored responses (`ResponseStore`): what is put comes back as it was, from a reopened file
too; the least recently used go first past the limit, the one just stored never; a delete
frees its bytes; one stored again replaces it."""

from __future__ import annotations

import json

from salabatch.serve.response_store import ResponseStore


def response(n: int, text: str = "") -> tuple[dict, list[dict], int]:
    """A response, its conversation (a turn it continued, its input, its answer), 1 input."""
    body = {"id": f"resp_{n}", "object": "response", "output_text": text, "metadata": {"é": n}}
    earlier = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "yes"}]
    asked = {"role": "user", "content": f"question {n} {text}"}
    return body, [*earlier, asked, {"role": "assistant", "content": text}], 1


def size(n: int, text: str = "") -> int:
    body, conversation, _ = response(n, text)
    return sum(len(json.dumps(x, ensure_ascii=False).encode()) for x in (body, conversation))


def test_a_stored_response_comes_back_from_a_reopened_file(tmp_path):
    path = tmp_path / "responses.sqlite"
    store = ResponseStore(path)
    store.put(*response(1, "ünïcode ✓"))
    store.put(*response(2))
    assert store.delete("resp_2") and not store.delete("resp_2")
    store.close()
    again = ResponseStore(path)
    assert again.get("resp_1") == response(1, "ünïcode ✓")
    assert again.get("resp_1").input_messages == [response(1, "ünïcode ✓")[1][2]]
    assert again.get("resp_2") is None and again.get("resp_3") is None
    assert again.get("\ud800") is None and not again.delete("\ud800")  # JSON allows it
    assert again.bytes == size(1, "ünïcode ✓")
    again.close()


def test_the_least_recently_used_go_first_past_the_limit(tmp_path):
    one = size(1)  # every response here is as long
    path = tmp_path / "responses.sqlite"
    store = ResponseStore(path, limit=3 * one)
    for n in (1, 2, 3):
        store.put(*response(n))
    assert store.get("resp_1") is not None  # now used after 2 and 3
    store.put(*response(4))
    assert store.get("resp_2") is None
    assert [store.get(f"resp_{n}") is not None for n in (1, 3, 4)] == [True] * 3
    store.close()
    # the order of use is kept in the file: 1, 3, 4 were used last in that order
    again = ResponseStore(path, limit=3 * one)
    again.put(*response(5))
    assert again.get("resp_1") is None and again.bytes == 3 * one
    # a response over the whole limit is kept alone, the others dropped
    again.put(*response(6, "x" * (4 * one)))
    assert again.get("resp_6") is not None
    assert [again.get(f"resp_{n}") for n in (3, 4, 5)] == [None] * 3
    assert again.bytes == size(6, "x" * (4 * one))
    again.close()


def test_a_response_stored_again_replaces_it():
    """(A background response: stored queued, then again when it ends.) Its bytes are the new
    one's; it is the most recently used."""
    store = ResponseStore(limit=size(1) + size(1, "ab") - 1)
    store.put(*response(1))
    store.put(*response(2))
    store.put(*response(1, "ab"))  # longer: over the limit, the other goes
    assert store.get("resp_1") == response(1, "ab") and store.get("resp_2") is None
    assert store.bytes == size(1, "ab")
    queued, conversation, inputs = response(3)
    store.put(queued | {"status": "queued"}, conversation, inputs)
    assert [u.stored.response["id"] for u in store.unfinished()] == ["resp_3"]
    store.put(queued | {"status": "completed"}, conversation, inputs)
    assert store.unfinished() == []


def test_a_background_runs_record_ends_with_the_response_and_counts_unclean_starts(tmp_path):
    """`started` records a run (its body, one more start), `stopped` a clean stop (the start
    given back); a response stored as ended, or deleted, ends its run; `unfinished` lists the
    queued and in-progress ones, the oldest first, with their runs (None: none recorded), from a
    reopened file too; a run whose response was dropped is forgotten when the file opens."""
    path = tmp_path / "responses.sqlite"
    store = ResponseStore(path)

    def put(n: int, status: str, created_at: int) -> None:
        body, conversation, inputs = response(n)
        store.put(body | {"status": status, "created_at": created_at}, conversation, inputs)

    put(1, "in_progress", 20)
    put(2, "queued", 10)
    put(3, "in_progress", 30)
    put(4, "completed", 5)
    store.started("resp_1", {"input": "one"})
    store.started("resp_1", {"input": "one", "seed": 7})
    store.started("resp_3", {"input": "three"})
    store.stopped("resp_3")
    store.started("resp_9", {"input": "a response not stored"})
    got = [(u.stored.response["id"], u.body, u.starts) for u in store.unfinished()]
    assert got == [
        ("resp_2", None, 0),
        ("resp_1", {"input": "one", "seed": 7}, 2),
        ("resp_3", {"input": "three"}, 0),
    ]
    assert store.unfinished()[1].stored.history == response(1)[1][:2]
    put(1, "completed", 20)  # its run ended
    assert store.delete("resp_3")
    store.close()
    again = ResponseStore(path)
    assert [(u.stored.response["id"], u.body) for u in again.unfinished()] == [("resp_2", None)]
    again.put(*response(3))  # stored again: no run of before comes back with it
    again.put(response(5)[0] | {"status": "in_progress"}, *response(5)[1:])
    assert [u.body for u in again.unfinished()] == [None, None]
    count = again._db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]  # noqa: SLF001
    assert count == 0  # resp_9's, whose response was never stored, went when the file opened
    again.close()
