"""`salabatch generate` and `salabatch convert` take mlx-lm's spellings of their arguments; a
converted checkpoint validates."""

from __future__ import annotations

import pytest
from click.testing import CliRunner, Result

from salabatch.cli import main
from salabatch.cli.main import DRAFTS as CLI_DRAFTS
from salabatch.engine import generate as generate_module
from salabatch.engine.config import ModelConfig
from salabatch.engine.quantize import BITS, GROUP_SIZES
from salabatch.engine.speculative import DRAFTS, OFF, Speculation
from tests.cli.test_jobs import validate
from tests.drafts import record_generators


def convert(*args: str) -> Result:
    return CliRunner().invoke(main, ["convert", *args])


def test_validate_a_quantized_checkpoint(tmp_path, tiny):
    result = convert("builtin:random", str(tmp_path / "q"), "--q-bits", "6", "--q-group-size", "32")
    assert result.exit_code == 0, result.output
    result = validate(str(tmp_path / "q"))
    assert result.exit_code == 0 and "6-bit, group size 32" in result.stdout


def test_convert_takes_mlx_lm_spellings(tmp_path, tiny):
    ours = convert(str(tiny), str(tmp_path / "a"), "--bits", "4")
    theirs = convert("--hf-path", str(tiny), "--mlx-path", str(tmp_path / "b"), "-q")
    assert ours.exit_code == theirs.exit_code == 0, theirs.output
    a, b = (ModelConfig.from_file(tmp_path / x).quantization for x in "ab")
    assert (a.bits, a.group_size) == (b.bits, b.group_size) == (4, 64)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()

    missing = convert(str(tiny), str(tmp_path / "c"))
    assert missing.exit_code == 2 and "-q for 4 bits" in missing.output
    odd = convert(str(tiny), str(tmp_path / "c"), "--q-bits", "7")
    assert odd.exit_code == 2 and "'7' is not one of" in odd.output
    # The CLI lists what quantize.py supports (it cannot import it: MLX).
    options = {p.name: p for p in main.commands["convert"].params}
    assert list(options["bits"].type.choices) == [str(b) for b in BITS]
    assert list(options["head_bits"].type.choices) == [str(b) for b in BITS]
    assert list(options["group_size"].type.choices) == [str(g) for g in GROUP_SIZES]


def test_convert_head_bits(tmp_path, tiny):
    result = convert(str(tiny), str(tmp_path / "q"), "-q", "--head-bits", "8")
    assert result.exit_code == 0, result.output
    quant = ModelConfig.from_file(tmp_path / "q").quantization
    assert (quant.bits, quant.overrides) == (4, {"lm_head": {"group_size": 64, "bits": 8}})
    result = validate(str(tmp_path / "q"))
    assert result.exit_code == 0 and "4-bit, group size 64, 1 module set apart" in result.stdout


def test_generate_takes_mlx_lm_spellings(tiny):
    def generate(*args: str, stdin: str | None = None) -> Result:
        result = CliRunner().invoke(main, ["generate", *args], input=stdin)
        assert result.exit_code == 0, result.output
        return result

    ours = generate("builtin:random", "Say hi.", "--max-tokens", "4", "--system", "Brief.")
    for args in (
        (
            "--model",
            "builtin:random",
            "--prompt",
            "Say hi.",
            "-m",
            "4",
            "--system-prompt",
            "Brief.",
        ),
        ("--model", "builtin:random", "Say hi.", "-m", "4", "--system", "Brief."),
        ("builtin:random", "-p", "Say hi.", "-m", "4", "--system", "Brief.", "--temp", "0"),
    ):
        assert generate(*args).stdout == ours.stdout, args
    piped = generate("builtin:random", "-", "-m", "4", "--system", "Brief.", stdin="Say hi.")
    assert piped.stdout == ours.stdout
    sampled = generate("builtin:random", "Say hi.", "-m", "4", "--temp", "0.9", "--min-p", "0.1")
    assert sampled.stdout.strip()

    for args, message in (
        (("builtin:random",), "give MODEL and PROMPT"),
        (("--model", "builtin:random", "a", "b"), "unexpected argument 'b'"),
    ):
        result = CliRunner().invoke(main, ["generate", *args])
        assert result.exit_code == 2 and message in result.output
    # a prompt piped in bytes that are no UTF-8: a usage error, not a Python one (exit 1)
    result = CliRunner().invoke(main, ["generate", "builtin:random", "-"], input=b"hi \xff")
    assert result.exit_code == 2, result.output
    assert "standard input is not UTF-8 (byte 0xff at offset 3)" in result.output


def test_generate_shows_a_long_prefills_progress_on_a_terminal(tiny, monkeypatch):
    """A prompt of several chunks: "[prefilling N of M prompt tokens]" in place on a terminal's
    standard error, cleared before the answer; nothing where standard error is not a terminal
    (a log), nor for a prompt of one chunk."""
    import click
    import click.testing

    args = ["generate", "builtin:random", "-", "-m", "3", "--prefill-chunk", "16"]
    prompt = "The ferry to Eastwick leaves at 7:10 from the north quay. " * 4

    def generate(*args: str) -> Result:
        result = CliRunner().invoke(main, args, input=prompt, color=True)
        assert result.exit_code == 0, result.output
        return result

    piped = generate(*args)
    assert "prefilling" not in piped.stderr
    monkeypatch.setattr(click.testing._NamedTextIOWrapper, "isatty", lambda self: True)
    shown = generate(*args)
    assert shown.stdout == piped.stdout
    # each line rewrites the last: a carriage return, erase the line, the text dimmed
    assert "\r\x1b[K[prefilling 16 of " in shown.stderr
    texts = [click.unstyle(line) for line in shown.stderr.split("\r")[1:]]
    total = int(texts[0].split(" of ")[1].split()[0])
    done = list(range(16, total, 16))
    assert len(done) >= 3
    assert texts[: len(done)] == [f"[prefilling {n:,} of {total:,} prompt tokens]" for n in done]
    assert texts[len(done)].startswith("prompt ")  # cleared; then the timings' line

    short = generate(*args[:-1], "2048")
    assert "prefilling" not in short.stderr


def test_generate_draft_flags_reach_the_generator(tiny, monkeypatch):
    seen = record_generators(monkeypatch, generate_module)

    def generate(*args: str) -> Result:
        return CliRunner().invoke(main, ["generate", "builtin:random", "Say hi.", "-m", "4", *args])

    plain = generate()
    assert plain.exit_code == 0, plain.output
    assert seen.speculations == [OFF]
    drafted = generate("--draft", "layers", "--num-draft-tokens", "2", "--draft-layers", "3")
    assert drafted.exit_code == 0, drafted.output
    assert seen.speculations[-1] == Speculation("layers", 2, 3)
    assert drafted.stdout == plain.stdout  # greedy: the same answer
    for args, message in (
        (("--draft", "medusa"), "'medusa' is not one of 'off', 'lookup', 'layers', 'auto'"),
        (("--num-draft-tokens", "0"), "0 is not in the range x>=1"),
        (("--draft-layers", "0"), "0 is not in the range x>=1"),
    ):
        refused = generate(*args)
        assert refused.exit_code == 2 and message in refused.output, refused.output
    # The CLI lists the engine's drafts (it cannot import speculative.py before the BLAS loads).
    assert CLI_DRAFTS == DRAFTS


def test_generate_prints_an_answer_that_only_began_like_a_think_block(tiny, monkeypatch):
    """Text that might open <think> ("<", "<th") is held back until it is clear; an answer
    that ended there was never printed (the API gave '<', the CLI an empty line)."""
    from salabatch.api import GenerationResponse
    from salabatch.engine import session

    def answering(*pieces: str):
        def stream(*args, **kwargs):
            for n, piece in enumerate(pieces, 1):
                last = n == len(pieces)
                yield GenerationResponse(piece, 5, 3, 1.0, n, 1.0, 0.0, "length" if last else None)

        return stream

    for pieces, shown in (
        (["<"], "<"),
        (["<", "th"], "<th"),
        ([" <th", "ink"], "<think"),
        (["<think>", "why", "</think>", " Yes."], "Yes."),
        (["<think>", "cut short"], ""),  # a think block that never closed: no answer
    ):
        monkeypatch.setattr(session, "stream_generate", answering(*pieces))
        result = CliRunner().invoke(main, ["generate", "builtin:random", "Say hi.", "-m", "4"])
        assert result.exit_code == 0, result.output
        assert result.stdout == shown + "\n", pieces


def test_perplexity_scores_each_document_and_by_position(tiny, tmp_path, monkeypatch):
    """`salabatch perplexity` over a folder: each readable document's mean negative
    log-likelihood is `salabatch.score`'s over its tokens, the total weighs documents by their
    scored tokens, the spans by position count every scored token once; --max-tokens cuts a
    document (a note says so); an empty file is an error line, the others are scored, exit 3.
    --json writes the same figures."""
    import json
    import math

    from salabatch.api import load, score
    from salabatch.cli import model as model_cli

    monkeypatch.setattr(model_cli.Positions, "FIRST", 16)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The supplier owes the buyer ten crates of apples. " * 12)
    # special-token text in a document is text, as `run` reads it (it was read as control ids)
    (docs / "b.md").write_text("# Terms\n\nPayment is due in 30 days.<|im_end|></s>\n")
    (docs / "empty.txt").write_text("")
    out = tmp_path / "ppl.json"
    args = ["perplexity", str(tiny), str(docs), "--json", str(out), "--prefill-chunk", "64"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 3, result.output
    assert "error in document empty.txt" in result.stderr
    report = json.loads(out.read_text())
    model, tok = load(str(tiny))
    rows = {r["document"]: r for r in report["documents"]}
    assert set(rows) == {"a.txt", "b.md"} and report["failed"] == 1
    scored = 0
    for name, row in rows.items():
        ids = tok.encode((docs / name).read_text(), add_bos=tok.add_bos_token, special=False)
        nll = [-x.logprob for x in score(model, tok, ids)]
        assert row["tokens"] == len(ids) and row["nll"] == pytest.approx(sum(nll) / len(nll))
        assert row["scored"] == len(nll) == len(ids) - 1  # the first token has no prediction
        assert row["perplexity"] == pytest.approx(math.exp(row["nll"]))
        assert f"{name:<40} {len(ids):>9,}" in result.stdout
        scored += len(nll)
    total = sum(r["nll"] * (r["tokens"] - 1) for r in rows.values()) / scored
    assert report["total"]["nll"] == pytest.approx(total)
    spans = report["by_position"]
    assert sum(s["tokens"] for s in spans) == scored
    assert [(s["from"], s["to"]) for s in spans][:3] == [(1, 16), (16, 32), (32, 64)]
    assert spans[0]["tokens"] == 15 * 2  # positions 1-15 of both documents

    cut = CliRunner().invoke(
        main, ["perplexity", str(tiny), str(docs / "a.txt"), "--max-tokens", "40", "--json", "-"]
    )
    assert cut.exit_code == 0, cut.output
    # its length is not said: only what 40 tokens can take was read (it said "of 722" of 5,984)
    assert "a.txt: the first 40 tokens (--max-tokens; the rest is not read)" in cut.stderr
    assert json.loads(cut.stdout)["documents"][0]["tokens"] == 40  # the table on stderr
    assert "a.txt" in cut.stderr


def test_perplexity_of_a_text_bigger_than_the_context_scores_its_first_tokens(
    tiny, tmp_path, monkeypatch
):
    """A text file over what the model's context can hold (16 bytes a token) was refused
    ("too large ... raise max_context", exit 3) though README says such a document is scored
    over its first tokens; only what they can take is read. --json takes `~`."""
    import json

    big = tmp_path / "big.txt"
    line = "The supplier owes the buyer ten crates of apples. "
    big.write_text(line * (16 * 2**20 // len(line) + 1000))  # > 16 MiB: 1M tokens' bytes
    monkeypatch.setenv("HOME", str(tmp_path))
    args = ["perplexity", str(tiny), str(big), "--max-tokens", "40", "--json", "~/ppl.json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "the first 40 tokens (--max-tokens; the rest is not read)" in result.stderr
    assert json.loads((tmp_path / "ppl.json").read_text())["documents"][0]["tokens"] == 40


def test_perplexity_reports_a_path_that_names_nothing_and_scores_the_others(tmp_path):
    """A PATH that does not exist, or a folder with nothing to read, is an error line naming
    that PATH (it was `documents[1].path`, the job file's word, and no document was scored);
    the other PATHs are scored, exit 3."""
    import json

    doc = tmp_path / "a.txt"
    doc.write_text("The gate code is 4411.\n")
    (tmp_path / "empty").mkdir()
    missing, empty = tmp_path / "nowhere.txt", tmp_path / "empty"
    args = ["perplexity", "builtin:random", str(missing), str(doc), str(empty), "--json", "-"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 3, result.output
    assert f"error in {missing}: document path does not exist" in result.stderr
    assert f"error in {empty}: no .txt .md .pdf .jsonl files match" in result.stderr
    assert "documents[" not in result.stderr
    report = json.loads(result.stdout)
    assert [r["document"] for r in report["documents"]] == ["a.txt"] and report["failed"] == 2


def test_perplexity_checks_its_json_path_before_scoring(tmp_path, monkeypatch):
    """--json naming a folder, or under a file, is a usage error (exit 2) before the model
    loads (the figures of hours of scoring were lost at the end); missing folders are made."""
    import salabatch.api

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    doc = tmp_path / "a.txt"
    doc.write_text("The gate code is 4411.\n")
    monkeypatch.setattr(salabatch.api, "load", no_load)
    for target, message in ((tmp_path, "a folder, not a file"), (doc / "x.json", "cannot make")):
        result = CliRunner().invoke(
            main, ["perplexity", "builtin:random", str(doc), "--json", str(target)]
        )
        assert result.exit_code == 2 and message in result.output, result.output
    monkeypatch.undo()
    made = tmp_path / "new" / "deeper" / "pp.json"
    result = CliRunner().invoke(
        main, ["perplexity", "builtin:random", str(doc), "--json", str(made)]
    )
    assert result.exit_code == 0, result.output
    assert made.exists() and "documents" in made.read_text()
