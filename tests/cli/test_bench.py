"""`salabatch bench …` options: every count, size and list is checked by click, a usage error
(exit 2) naming the option, before any model loads or benchmark runs."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from salabatch.cli import main
from salabatch.cli.bench import SPEC_DRAFTS, SPEC_WORKLOADS, TOKENS, bench

BAD = [
    ("gla", "--repeat", "0"),
    ("sparse", "--contexts", "abc"),
    ("sparse", "--contexts", "0"),
    ("sparse", "--contexts", ","),
    ("sparse", "--prefill-tokens", "-1"),
    ("sparse", "--chunk", "0"),
    ("prefix", "--doc-tokens", "0"),
    ("prefix", "--questions", "0"),
    ("prefix", "--max-tokens", "0"),
    ("serve", "--soak", "-1"),
    ("serve", "--soak-documents", "0"),
    ("serve", "--soak-prefix-mb", "0"),
    ("serve", "--turn-tokens", "-1"),
    ("quant", "--contexts", "4K,x"),
    ("quant", "--hidden", "100"),
    ("quant", "--layers", "0"),
    ("quant", "--prefill", "0"),
    ("quant", "--steps", "0"),
    ("spec", "--workloads", "extraction,foo"),
    ("spec", "--batches", "1,0"),
    ("spec", "--drafts", "bogus"),
    ("spec", "--rounds", "0"),
    ("spec", "--tokens", "0"),
    ("spec", "--layers", "0"),
    ("long", "--contexts", "1K,0K"),
    ("long", "--batch", "0"),
    ("long", "--steps", "0"),
    ("long", "--chunk", "0"),
    ("needle", "--contexts", "0K"),
    ("needle", "--contexts", "4.5K"),
    ("needle", "--depths", "90..10"),
    ("scale", "--docs", "0"),
    ("scale", "--tokens", "0"),
    ("scale", "--actors", "1,-2"),
    ("scale", "--questions", "0"),
    ("scale", "--max-tokens", "0"),
]


@pytest.mark.parametrize(("command", "option", "value"), BAD)
def test_bad_options_are_usage_errors_naming_the_option(monkeypatch, command, option, value):
    """Before, `bench gla --repeat 0` raised IndexError, `sparse --contexts abc` ValueError,
    `needle --contexts 0K` ran on an empty context."""

    def never(*args, **kwargs):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr("salabatch.api.load", never)  # needle would load its model first
    got = CliRunner().invoke(main, ["bench", command, option, value])
    assert got.exit_code == 2, got.output
    assert f"Invalid value for '{option}'" in got.output
    assert got.exception is None or isinstance(got.exception, SystemExit)


def test_context_lists():
    assert TOKENS.convert("8192, 32K,,4k", None, None) == [8192, 32768, 4096]


def test_every_default_parses():
    """Each subcommand's defaults go through the same types (parsed, not run)."""
    for name, command in bench.commands.items():
        ctx = command.make_context(name, [])
        exposed = [p for p in command.params if p.expose_value]
        assert set(ctx.params) == {p.name for p in exposed}, name
        # an option given a default (a number, a list, a path) parses it to a value
        given = [p for p in exposed if isinstance(p.default, (int, float, str, list, tuple))]
        lost = [p.name for p in given if ctx.params[p.name] is None]
        assert given and not lost, f"{name}: defaults lost in parsing: {lost}"


def test_spec_choices_match_the_bench():
    from salabatch.bench import spec
    from salabatch.engine.speculative import DRAFTS

    assert SPEC_WORKLOADS == spec.WORKLOADS and SPEC_DRAFTS == spec.DRAFTS == DRAFTS


@pytest.mark.parametrize(
    ("out", "chart", "want"),
    [
        ("v1.2/result", None, "v1.2/result.png"),  # not v1.png, outside the folder asked for
        ("result", None, "result.png"),
        ("r.json", None, "r.png"),
        ("r.json", "mychart", "mychart.png"),  # as matplotlib saves it: what is printed
        ("r.json", "c.svg", "c.svg"),
        (None, None, None),
    ],
)
def test_a_chart_goes_where_it_is_said_to(out, chart, want):
    from salabatch.cli.bench import _chart_path

    assert _chart_path(out, chart) == want


@pytest.mark.parametrize("args", [["--out", "x.png"], ["--out", "r.json", "--chart", "r.json"]])
def test_a_chart_that_would_overwrite_the_json_is_refused_before_anything_runs(tmp_path, args):
    result = CliRunner().invoke(main, ["bench", "long", "--contexts", "1K", *args])
    assert result.exit_code == 2 and "would be --out itself" in result.output, result.output


@pytest.mark.parametrize("terminated", [False, True])
def test_a_stopped_benchmark_exits_as_a_stopped_run(monkeypatch, terminated):
    """Ctrl-C, or SIGTERM (taken as Ctrl-C: the `_server` blocks of bench serve and batch then
    stop their server), ends a benchmark with 130 or 143 and a line saying so."""
    import os
    import signal

    from salabatch.bench import gla

    def stopped(repeat):
        if terminated:
            os.kill(os.getpid(), signal.SIGTERM)
        raise KeyboardInterrupt

    monkeypatch.setattr(gla, "run", stopped)
    result = CliRunner().invoke(main, ["bench", "gla"])
    assert result.exit_code == (143 if terminated else 130), result.output
    assert ("terminated (SIGTERM)" if terminated else "interrupted") in result.output


def test_an_out_file_is_checked_before_the_benchmark_runs(monkeypatch, tmp_path):
    """--out (and --chart) in a folder that does not exist: the folder is made; a folder, or a
    path under a file, is a usage error before anything runs (the benchmark ran, then failed
    writing: its figures lost, exit 1). `~` is the home folder."""
    from salabatch.bench import gla

    ran = []
    monkeypatch.setattr(gla, "run", lambda repeat: ran.append(repeat) or {"ops": []})
    (tmp_path / "afile").write_text("x")
    for bad in (tmp_path, tmp_path / "afile" / "x.json"):
        result = CliRunner().invoke(main, ["bench", "gla", "--out", str(bad)])
        assert result.exit_code == 2 and "--out" in result.output and not ran, result.output
    made = tmp_path / "new" / "deeper" / "g.json"
    assert CliRunner().invoke(main, ["bench", "gla", "--out", str(made)]).exit_code == 0
    assert json.loads(made.read_text())["bench"] == "gla"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert CliRunner().invoke(main, ["bench", "gla", "--out", "~/home.json"]).exit_code == 0
    assert (tmp_path / "home.json").is_file()


def test_needle_quick_fills_only_what_is_not_given(monkeypatch):
    """--quick's preset gives what the command line does not: an explicit --documents was
    overridden by it (--contexts and --depths were not)."""
    import salabatch.api
    from salabatch.bench import needle

    asked = {}

    def run(model, tokenizer, contexts, depths, *, documents, **kwargs):
        asked.update(contexts=contexts, depths=depths, documents=documents)
        raise KeyboardInterrupt  # enough: what it was asked is known

    monkeypatch.setattr(salabatch.api, "load", lambda ref: (None, None))
    monkeypatch.setattr(needle, "run", run)
    CliRunner().invoke(main, ["bench", "needle", "--quick", "--documents", "2"])
    assert asked == {"contexts": (4096, 8192), "depths": (0.1, 0.5, 0.9), "documents": 2}
    CliRunner().invoke(main, ["bench", "needle", "--quick", "--contexts", "2K"])
    assert asked["contexts"] == [2048] and asked["documents"] == 1


def test_long_graph_with_a_chart_is_refused_before_it_counts(tmp_path):
    """--graph prints counts and draws nothing: its --chart was ignored without a word."""
    result = CliRunner().invoke(main, ["bench", "long", "--graph", "--chart", str(tmp_path / "g")])
    assert result.exit_code == 2 and "--chart" in result.output, result.output


def test_bench_serve_reads_its_document_as_run_does_and_refuses_one_without_text(tmp_path):
    """An empty --document ended in "the bench's salabatch run failed" after the servers
    started; a PDF was read as UTF-8 text (UnicodeDecodeError)."""
    from salabatch.bench import serve as serving
    from tests import REPO

    (tmp_path / "empty.txt").write_text("")
    result = CliRunner().invoke(
        main, ["bench", "serve", "--document", str(tmp_path / "empty.txt"), "--clients", "1"]
    )
    assert result.exit_code == 2 and "--document" in result.output and "empty" in result.output
    pdf = next((REPO / "jobs" / "demo" / "docs").glob("*.pdf"))
    text = serving.document_text(pdf)  # its extracted text, not its bytes
    assert len(text.split()) > 50 and "%PDF" not in text and "endobj" not in text
