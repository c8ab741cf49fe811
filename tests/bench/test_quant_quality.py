"""`salabatch bench quant --model`: what 8-bit and 4-bit cost a model's answers, on a tiny needle
grid with the builtin model's random weights (the shape of the result; a trained model's figures
are in benchmarks/)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from salabatch.bench import quant, quant_quality
from salabatch.cli import main
from salabatch.errors import ConfigError


@pytest.fixture(scope="module")
def result(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    return quant_quality.run(
        "builtin:random", contexts=[500], depths=[0.3, 0.7], documents=1, logit_samples=2,
        logit_length=200, progress=print,
    )  # fmt: skip


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_a_row_per_format_against_float32(result):
    rows = {r["format"]: r for r in result["results"]}
    assert list(rows) == ["float32", "8bit", "4bit", "4bit-g32", "4bit-h8"]
    assert result["needles"] == 2
    assert rows["float32"]["agreement"] == 1.0 and rows["float32"]["logit_rel_rms"] == 0.0
    # fewer bits or larger groups, further from float32 (on any weights)
    rms = {f: r["logit_rel_rms"] for f, r in rows.items()}
    assert 0 < rms["8bit"] < rms["4bit-g32"] < rms["4bit"] < 1
    assert rms["8bit"] < rms["4bit-h8"] < rms["4bit"]
    for r in rows.values():
        assert len(r["answers"]) == 2 and 0 <= r["accuracy"] <= 1 and 0 <= r["agreement"] <= 1
        same = sum(a == b for a, b in zip(r["answers"], rows["float32"]["answers"], strict=True))
        assert r["agreement"] == same / 2
    text = quant_quality.table(result)
    assert "      8bit |" in text and "   4bit-g32 |" in text
    assert "2 needles (contexts [500])" in text


def test_an_unknown_format_is_refused():
    with pytest.raises(ConfigError, match="unknown format"):
        quant_quality.run("builtin:random", formats=["4bits"])
    with pytest.raises(ConfigError, match="bit width"):
        quant_quality.run("builtin:random", formats=["4bit-h7"])
    assert quant.parse_format("4bit-g32") == (4, 32, 4)
    assert quant.parse_format("8bit") == (8, 64, 8)
    assert quant.parse_format("4bit-g32-h8") == (4, 32, 8)


def test_cli_writes_the_json(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "q.json"
    args = ["bench", "quant", "--model", "builtin:random", "--contexts", "300", "--documents", "1"]
    args += ["--formats", "8bit", "--logit-samples", "1", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["bench"] == "quant-quality" and [r["format"] for r in data["results"]] == [
        "float32",
        "8bit",
    ]
    assert not out.with_suffix(".png").exists()
