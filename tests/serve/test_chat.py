"""`salabatch chat`: the terminal chat over a real ServeEngine on builtin:tiny, driven by
scripted input: documents (text and PDF) prefilled once, later turns resuming from them, /save,
/reset, and Ctrl-C stopping an answer but not the session."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from salabatch.cli import main
from salabatch.errors import Terminated
from salabatch.serve.chat import ChatSession, run_chat
from salabatch.serve.engine import SNAPSHOT_MIN, ServeEngine
from tests import REPO

MODEL = "builtin:tiny"
DOCS = REPO / "jobs" / "demo" / "docs"
SUMMARY = re.compile(
    r"\[(\d+) tokens, [\d.]+ tok/s; prompt (\d+) tokens, (\d+) cached; "
    r"(?:drafts (\d+)/(\d+) accepted; )?first token after [\d.]+ s; (stop|length)\]"
)
STOPPED = re.compile(r"\[stopped after (\d+) tokens, (?:[\d.]+|–) tok/s\]")


def turns(text: str) -> list[dict]:
    """The summary lines of a chat's output, in order."""
    return [
        {
            "completion": int(c),
            "prompt": int(p),
            "cached": int(k),
            "accepted": int(a or 0),
            "drafted": int(d or 0),
            "finish": f,
        }
        for c, p, k, a, d, f in SUMMARY.findall(text)
    ]


def test_chat_over_documents_resumes_each_turn_from_them_and_saves_the_conversation(tmp_path, tiny):
    _, tok = tiny
    for name in ("redwater-robotics.txt", "westcliff-energy.pdf"):
        shutil.copy(DOCS / name, tmp_path / name)
    script = [
        "Give the service provider of this agreement.",
        "Tell me the Client in the contract.",
        f"/save {tmp_path / 'conversation.json'}",
        "/reset",
        "Find the commencement date.",
        "/nonsense",
        "/quit",
        "never asked",
    ]
    result = CliRunner().invoke(
        main,
        [
            "chat",
            "--model",
            MODEL,
            "--document",
            str(tmp_path / "redwater-robotics.txt"),
            "--document",
            str(tmp_path / "westcliff-energy.pdf"),
            "--state-dir",
            str(tmp_path / "state"),
            "--max-tokens",
            "12",
        ],
        input="\n".join(script) + "\n",
    )
    assert result.exit_code == 0, result.output
    first, second, third = turns(result.stderr)  # the question after /quit was never asked

    saved = json.loads((tmp_path / "conversation.json").read_text())
    assert saved["documents"] == ["redwater-robotics.txt", "westcliff-energy.pdf"]
    system, *history = saved["messages"]
    assert system["role"] == "system" and "Redwater Robotics" in system["content"]
    assert "Westcliff" in system["content"]  # the PDF's text, extracted
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert [history[0]["content"], history[2]["content"]] == script[:2]
    for answer in (history[1]["content"], history[3]["content"]):
        assert answer in result.stdout  # what was streamed is what was kept

    system_ids = tok.chat_prompt_ids([system], think=False, add_generation_prompt=False)
    # held where the documents' text ends, before the template's end of turn (<|im_end|>, a
    # newline): a document added later resumes from there
    documents = len(system_ids) - 2
    turn_one = [system, history[0]]
    assert first["prompt"] == len(tok.chat_prompt_ids(turn_one, think=False))
    assert first["cached"] == 0  # a fresh state dir: the documents are prefilled once, here
    assert second["prompt"] == len(tok.chat_prompt_ids([system, *history[:3]], think=False))
    # the second turn resumes from the first's snapshot (the documents at least), so it
    # prefills at most SNAPSHOT_MIN tokens more than its own
    assert second["cached"] >= max(documents, first["prompt"] - SNAPSHOT_MIN)
    # after /reset the conversation is gone, the documents stay held
    reset = [system, {"role": "user", "content": script[4]}]
    assert third["prompt"] == len(tok.chat_prompt_ids(reset, think=False))
    assert third["cached"] >= documents
    assert "unknown command /nonsense" in result.stderr
    assert "[saved to" in result.stderr and "forgotten" in result.stderr


def test_a_document_added_mid_chat_resumes_from_the_documents_before_it(tmp_path):
    """`/document` appends to the system message: the next question resumes from the first
    document held up to its text's end (the end of the whole system message is no longer a
    prefix of the prompt), not from nothing; a folder given is named as one."""
    shutil.copy(DOCS / "redwater-robotics.txt", tmp_path / "doc.txt")
    (tmp_path / "note.txt").write_text("Note: the parking code is 9.\n")
    (tmp_path / "folder").mkdir()
    script = ["Who is the provider?", f"/document {tmp_path / 'note.txt'}", "And the code?"]
    script.append(f"/document {tmp_path / 'folder'}")
    args = ["chat", "--model", MODEL, "--document", str(tmp_path / "doc.txt")]
    args += ["--state-dir", str(tmp_path / "state"), "--max-tokens", "4"]
    result = CliRunner().invoke(main, args, input="\n".join(script) + "\n")
    assert result.exit_code == 0, result.output
    first, second = turns(result.stderr)
    assert first["cached"] == 0 and second["prompt"] > first["prompt"]
    # all but the few tokens of the first system message's end, and its first question
    assert second["cached"] >= first["prompt"] - 64 - len(script[0])
    assert "folder: a directory, not a document file" in result.stderr


def test_chat_drafts_from_the_documents_and_answers_as_without(tmp_path):
    """--draft lookup: the same greedy answers, with the drafts each turn made and accepted in
    its summary line."""
    shutil.copy(DOCS / "redwater-robotics.txt", tmp_path / "doc.txt")
    script = ["Give the service provider of this agreement.", "Find the commencement date."]
    runs = {}
    for draft in ("off", "lookup"):
        args = ["chat", "--model", MODEL, "--document", str(tmp_path / "doc.txt")]
        args += ["--state-dir", str(tmp_path / draft), "--max-tokens", "24", "--draft", draft]
        result = CliRunner().invoke(main, args, input="\n".join(script) + "\n")
        assert result.exit_code == 0, result.output
        runs[draft] = (result.stdout, turns(result.stderr))
    assert runs["lookup"][0] == runs["off"][0]  # the answers, as streamed
    assert [t["completion"] for t in runs["lookup"][1]] == [t["completion"] for t in runs["off"][1]]
    assert all(t["drafted"] == 0 for t in runs["off"][1])
    drafted = sum(t["drafted"] for t in runs["lookup"][1])
    assert drafted > 0 and 0 < sum(t["accepted"] for t in runs["lookup"][1]) <= drafted


def test_ctrl_c_stops_the_answer_not_the_session(tmp_path, tiny):
    """Ctrl-C while an answer streams (a KeyboardInterrupt raised where the text is shown, as
    SIGINT raises one wherever the main thread is) cancels its job; the next question is
    answered as usual."""
    model, tok = tiny
    document = (DOCS / "redwater-robotics.txt").read_text()
    lines = iter(["A question that runs long.", "Who is the provider?"])
    shown, notes, interrupted = [], [], []

    def write(text: str) -> None:
        if text.strip() and not interrupted:
            interrupted.append(text)
            raise KeyboardInterrupt
        shown.append(text)

    with ServeEngine(model, tok, batch_size=1, max_queue=2) as engine:
        session = ChatSession(engine, tok, documents=[("a.txt", document)], max_tokens=400)
        run_chat(session, lambda: next(lines, None), write, notes.append)
        stats = engine.stats()
        deadline = time.monotonic() + 120  # a loaded machine: the engine thread may lag
        while stats["requests_cancelled_total"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
            stats = engine.stats()
    (first,) = STOPPED.findall(notes[0])
    assert int(first) < 400
    (second,) = turns("\n".join(notes))
    assert second["finish"] in ("stop", "length") and second["cached"] > 0
    assert stats["requests_cancelled_total"] == 1 and stats["requests_finished_total"] == 1
    # the first answer stopped early: far short of its 400 tokens
    assert stats["completion_tokens_total"] - second["completion"] < 400
    assert [m["role"] for m in session.history] == ["user", "assistant"] * 2


def test_sigterm_ends_the_session_where_ctrl_c_goes_on(tiny):
    """SIGTERM raises a KeyboardInterrupt (`Terminated`): chat took it for a Ctrl-C and went
    on, while reading a line or streaming an answer, so `kill` never ended it."""
    model, tok = tiny
    with ServeEngine(model, tok, batch_size=1, max_queue=2) as engine:
        session = ChatSession(engine, tok, max_tokens=400)

        reads = iter([Terminated, None])

        def read_line() -> str | None:
            if (got := next(reads)) is Terminated:
                raise Terminated
            return got

        with pytest.raises(Terminated):
            run_chat(session, read_line, lambda text: None, lambda line: None)

        def write(text: str) -> None:
            if text.strip():
                raise Terminated

        lines = iter(["A question that runs long.", "never asked"])
        with pytest.raises(Terminated):
            run_chat(session, lambda: next(lines, None), write, lambda line: None)
        deadline = time.monotonic() + 120
        while engine.stats()["requests_cancelled_total"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.stats()["requests_cancelled_total"] == 1


def test_kill_ends_a_chat_waiting_for_a_line_with_143():
    proc = subprocess.Popen(
        [sys.executable, "-m", "salabatch.cli", "chat", MODEL, "--max-tokens", "4"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        seen = ""
        while "chat with" not in seen and time.monotonic() < deadline:
            seen += proc.stderr.readline()  # the greeting: the loop is reading a line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        proc.kill()
        proc.wait()


def test_chat_takes_the_model_as_an_argument_too(tmp_path):
    """`salabatch chat M`, as `generate M` and `serve M`: the same session as `--model M`."""
    shutil.copy(DOCS / "redwater-robotics.txt", tmp_path / "doc.txt")
    runs = []
    for spelled in ([MODEL], ["--model", MODEL]):
        args = ["chat", *spelled, "--document", str(tmp_path / "doc.txt"), "--max-tokens", "8"]
        args += ["--state-dir", str(tmp_path / "state")]
        result = CliRunner().invoke(main, args, input="Who is the provider?\n")
        assert result.exit_code == 0, result.output
        assert f"chat with {MODEL};" in result.stderr
        runs.append(result.stdout)
    assert runs[0] == runs[1]


def test_a_document_that_cannot_be_read_is_refused_before_the_model_loads(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = CliRunner().invoke(main, ["chat", "--model", MODEL, "--document", str(empty)])
    assert result.exit_code == 2 and "empty" in result.output and "--document" in result.output


def test_a_line_that_is_not_utf8_is_an_error_not_the_end_of_the_session(tiny):
    """A terminal that is not UTF-8 gives Python its bytes as surrogates (`Caf\\xe9`): the turn
    is refused with the byte named, and the next question is answered."""
    model, tok = tiny
    lines = iter(["Caf\udce9?", "Who is the provider?"])
    notes: list[str] = []
    with ServeEngine(model, tok, batch_size=1, max_queue=2) as engine:
        session = ChatSession(engine, tok, max_tokens=4)
        run_chat(session, lambda: next(lines, None), lambda text: None, notes.append)
    assert notes[0].startswith("error:") and "byte 0xe9" in notes[0], notes
    assert len(turns("\n".join(notes))) == 1
    assert [m["role"] for m in session.history] == ["user", "assistant"]


def test_text_utf8_cannot_hold_never_reaches_the_prompt(tmp_path, tiny):
    """A file name of Latin-1 bytes, a saved conversation holding "\\udcff", a --system of
    such bytes: the next question (and /save) failed with a UnicodeEncodeError, exit 1."""
    model, tok = tiny
    named = tmp_path / "caf\udce9.txt"  # the byte 0xe9, as Python names it
    named.write_text("The provider is Redwater Robotics.")
    saved = tmp_path / "saved.json"
    saved.write_text(
        json.dumps({"messages": [{"role": "user", "content": "x\udcff"}], "documents": []})
    )
    lines = iter([f"/document {named}", f"/load {saved}", "Who?", f"/save {tmp_path / 'o.json'}"])
    notes: list[str] = []
    with ServeEngine(model, tok, batch_size=1, max_queue=2) as engine:
        session = ChatSession(engine, tok, max_tokens=4)
        run_chat(session, lambda: next(lines, None), lambda text: None, notes.append)
    assert notes[0].startswith("[added caf\ufffd.txt (")
    cannot = "a text UTF-8 cannot hold (lone surrogate U+DCFF at character 1) in its messages"
    assert notes[1] == f"error: {saved}: {cannot}"
    assert len(turns("\n".join(notes))) == 1 and notes[-1].startswith("[saved to ")
    result = CliRunner().invoke(main, ["chat", MODEL, "--system", "bad \udcff"])
    assert result.exit_code == 2 and "--system" in result.output and "byte 0xff" in result.output


def test_the_summary_rate_is_the_engines_decode_rate():
    """decode_s runs from the first token to the last: n − 1 tokens after the first, as
    `salabatch generate` counts them (n / decode_s showed 2 tokens at twice their rate)."""
    from salabatch.serve.chat import Turn

    turn = Turn(48, 0, 2, 0.05, 0.01, "length")
    assert "[2 tokens, 100.0 tok/s;" in turn.summary()
    assert Turn(48, 0, 201, 0.05, 0.5, "length").decode_tok_s == 400.0
    assert Turn(48, 0, 1, 0.05, 0.0, "stop").decode_tok_s is None  # one token: no rate
    assert Turn(0, 0, 5, 0.1, 2.0, "cancelled").summary() == "[stopped after 5 tokens, 2.0 tok/s]"


def test_a_document_added_mid_session_and_a_conversation_loaded_later(tmp_path, tiny):
    """/document FILE puts one more document (here a PDF) in the system message: the next
    question's prompt holds it, with the conversation so far after it. A conversation saved
    and then loaded in a new session goes on where it was, resuming from what the engine held;
    a file that cannot be read or loaded is an error line, and the session goes on."""
    model, tok = tiny
    shutil.copy(DOCS / "westcliff-energy.pdf", tmp_path / "w.pdf")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.json").write_text('{"messages": [{"role": "tool", "content": "x"}]}')
    saved = tmp_path / "c.json"
    lines = iter(
        [
            "Who is the provider?",
            f"/document {tmp_path / 'w.pdf'}",
            f"/document {tmp_path / 'empty.txt'}",
            f"/document {tmp_path / 'missing.txt'}",
            "Who is the client?",
            f"/save {saved}",
        ]
    )
    notes: list[str] = []
    document = (DOCS / "redwater-robotics.txt").read_text()
    with ServeEngine(model, tok, batch_size=1, max_queue=2) as engine:
        session = ChatSession(engine, tok, documents=[("r.txt", document)], max_tokens=6)
        run_chat(session, lambda: next(lines, None), lambda text: None, notes.append)
        assert session.documents == ["r.txt", "w.pdf"]
        system = session.system[0]["content"]
        assert system.index("Document: r.txt") < system.index("Document: w.pdf")
        assert "Westcliff" in system  # the PDF's text
        first, second = turns("\n".join(notes))
        asked = tok.chat_prompt_ids([*session.messages[:3], session.messages[3]], think=False)
        assert second["prompt"] == len(asked)
        assert sum("error:" in n for n in notes) == 2
        assert any("empty.txt" in n for n in notes) and any("missing.txt" in n for n in notes)

        later = ChatSession(engine, tok, max_tokens=6)  # a new session, the same engine
        more = iter([f"/load {tmp_path / 'bad.json'}", f"/load {saved}", "And the fee?"])
        notes.clear()
        run_chat(later, lambda: next(more, None), lambda text: None, notes.append)
    assert "messages[0]" in notes[0] and "[loaded" in notes[1]
    (third,) = turns("\n".join(notes))
    assert later.documents == ["r.txt", "w.pdf"] and later.system == session.system
    assert later.history[:4] == session.history and len(later.history) == 6
    assert third["prompt"] == len(tok.chat_prompt_ids(later.messages[:-1], think=False))
    assert third["cached"] >= second["prompt"] - SNAPSHOT_MIN  # the saved turns were held


def test_a_long_prefill_shows_its_progress_until_the_first_token(tiny):
    """While the first question prefills its documents (chunk by chunk), `status` gets the
    tokens done so far of the prompt's, counting up, then "" once before the answer shows;
    the next question, resumed from them, shows none (`every` short here, so that it shows)."""
    model, tok = tiny
    text = "\n\n".join([(DOCS / "redwater-robotics.txt").read_text()] * 4)  # ~2.6K tokens
    events: list[str] = []
    with ServeEngine(model, tok, batch_size=1, max_queue=2, prefill_chunk=256) as engine:
        session = ChatSession(engine, tok, documents=[("a.txt", text)], max_tokens=4)

        def show(piece) -> None:
            events.append("piece")

        first = session.ask("Who is the provider?", show, events.append, every=0.01)
        shown = [e for e in events if e.startswith("prefilling")]
        assert len(shown) >= 2, events
        done = [int(e.split()[1].replace(",", "")) for e in shown]
        totals = {int(e.split()[3].replace(",", "")) for e in shown}
        assert totals == {first.prompt_tokens} and done == sorted(done)
        assert done[-1] > done[0] and done[-1] <= first.prompt_tokens
        cleared = events.index("")
        assert events.count("") == 1 and all(e.startswith("prefilling") for e in events[:cleared])
        assert "piece" not in events[:cleared]
        events.clear()
        session.ask("And the client?", show, events.append, every=5.0)
        assert not [e for e in events if e.startswith("prefilling")]
