"""`salabatch bench scale` end to end, tiny (3 documents of ~200 tokens, 1 and 2 actors): its
JSON, rows and table. It measures nothing here; the numbers live in benchmarks/README.md."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from salabatch.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("ray", reason='Ray is an optional extra: pip install "salabatch[ray]"')
    out = tmp_path_factory.mktemp("scale") / "scale.json"
    args = ["bench", "scale", "--docs", "3", "--tokens", "200", "--actors", "1,2"]
    result = CliRunner().invoke(main, [*args, "--questions", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return result.stdout, json.loads(out.read_text())


@pytest.mark.ray
def test_every_configuration_answers_every_document_and_question(run):
    _, result = run
    assert result["bench"] == "scale" and result["device"] and result["ray"]
    assert result["cpus"] >= 1 and result["startup_s"] > 0
    assert (result["docs"], result["questions"]) == (3, 2)
    assert 150 <= result["doc_tokens"] <= 260  # ~200 tokens and the chat template around them
    got = [(r["executor"], r["actors"]) for r in result["results"]]
    assert got == [("local", 1), ("ray", 1), ("ray", 2)]
    for r in result["results"]:
        assert r["rows"] == 3 * 2 and r["errors"] == 0
        # wall_s is rounded to 10 ms, and the local run of 3 tiny documents takes ~0.3 s
        assert r["wall_s"] > 0 and r["docs_per_hour"] == pytest.approx(3 / r["wall_s"] * 3600, 0.05)


@pytest.mark.ray
def test_ratios_and_table_compare_ray_with_the_local_executor(run):
    text, result = run
    local, ray1, ray2 = result["results"]
    assert result["ratios"]["ray1_over_local"] == pytest.approx(
        ray1["wall_s"] / local["wall_s"], 0.02
    )
    speedup = result["ratios"]["speedup_vs_ray1"]
    assert speedup["1"] == 1.0 and speedup["2"] == pytest.approx(
        ray1["wall_s"] / ray2["wall_s"], 0.02
    )
    lines = text.splitlines()
    assert lines[0].startswith("3 documents of ~") and "start-up" in lines[0]
    assert [line.split()[:2] for line in lines[2:5]] == [["local", "1"], ["ray", "1"], ["ray", "2"]]
    assert lines[-1] == result["note"] and "model loads" in result["note"]


def test_the_documents_are_deterministic_and_distinct(tmp_path):
    from salabatch.bench.scale import write_documents

    def encode(text: str) -> list[int]:
        return text.split()

    write_documents(tmp_path / "a", 3, 50, encode)
    write_documents(tmp_path / "b", 3, 50, encode)
    texts = [p.read_text() for p in sorted((tmp_path / "a").iterdir())]
    assert texts == [p.read_text() for p in sorted((tmp_path / "b").iterdir())]
    assert len(set(texts)) == 3 and all(45 <= len(t.split()) <= 55 for t in texts)


def test_without_ray_it_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    result = CliRunner().invoke(main, ["bench", "scale", "--docs", "1"])
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1
    assert 'pip install "salabatch[ray]"' in result.output
