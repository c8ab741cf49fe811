"""`salabatch bench needle` on a tiny grid with the builtin model's random weights: the rows,
the grid, where each value sits in the prompt, the selection shares, the table, JSON and
heatmap. Its accuracy here is 0: that a trained model retrieves is measured in benchmarks/."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from salabatch.bench import needle
from salabatch.cli import main
from salabatch.engine.load import load_model
from salabatch.engine.tokenizer import load_tokenizer
from salabatch.models import resolve_model
from salabatch.train.data import EVAL, TaskGenerator

DENSE, SPARSE = 600, 2600  # builtin:random turns sparse at 2048 tokens
DEPTHS = [0.2, 0.8]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return resolve_model("builtin:random", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tokenizer(folder):
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def result(folder, tokenizer):
    return needle.run(load_model(folder), tokenizer, [DENSE, SPARSE], DEPTHS, progress=print)


def test_a_row_per_needle_and_a_cell_per_context_and_depth(result):
    rows = result["rows"]
    assert [(r["context"], r["depth"]) for r in rows] == [
        (n, d) for n in (DENSE, SPARSE) for d in DEPTHS
    ]
    for r in rows:
        assert r["correct"] == (r["answer"].strip() == r["value"])
        assert (r["miss"] is None) == r["correct"] and r["miss"] in (None, *needle.MISSES)
        assert abs(r["prompt_tokens"] - r["context"]) < 0.15 * r["context"]
    assert [(c["context"], c["depth"], c["needles"]) for c in result["grid"]] == [
        (n, d, 1) for n in (DENSE, SPARSE) for d in DEPTHS
    ]
    assert result["accuracy"] == sum(r["correct"] for r in rows) / len(rows)
    assert sum(result["misses"].values()) == sum(not r["correct"] for r in rows)
    places = result["places"]
    assert sum(p["needles"] for p in places.values()) == len(rows)
    assert sum(p["right"] for p in places.values()) == sum(r["correct"] for r in rows)


def test_each_context_asks_its_own_facts(result):
    values = {n: {r["value"] for r in result["rows"] if r["context"] == n} for n in (DENSE, SPARSE)}
    assert len(values[DENSE]) == len(values[SPARSE]) == len(DEPTHS)
    assert not values[DENSE] & values[SPARSE]


def test_a_wrong_answer_is_named_by_its_kind():
    assert needle.miss("47-1182", "47-1182", ["31951"]) is None
    assert needle.miss("31951", "47-1182", ["31951"]) == "another needle"
    assert needle.miss("16-482-317", "116-482-317", []) == "slip"  # a digit dropped
    assert needle.miss("58040.", "58040", []) == "slip"  # the sentence's full stop copied
    assert needle.miss("3235999999", "32359", []) == "slip"  # ran on past the value
    assert needle.miss("5374", "53716", []) == "slip"  # more than half right from the start
    assert needle.miss("Project Zenel", "412-610-546", []) == "other"  # the entity, not its value
    assert needle.miss("5282-798", "58040", ["31951"]) == "other"


def test_selection_is_given_per_sparse_layer_only_in_sparse_mode(result):
    layers = [str(i) for i in result["sparse_layers"]]
    assert layers and result["dense_len"] == 2048
    for r in result["rows"]:
        if r["context"] == DENSE:
            assert r["selected"] is None
        else:
            assert list(r["selected"]) == layers
    sparse_cells = [c for c in result["grid"] if "selected" in c]
    assert [c["context"] for c in sparse_cells] == [SPARSE, SPARSE]


def test_value_span_is_where_the_value_sits_in_the_prompt(tokenizer):
    samples = TaskGenerator(tokenizer, split=EVAL).needle_document(3, 1500, [0.1, 0.5, 0.9])
    document = samples[0].document
    prompt = tokenizer.document_prompt(document, system=None, think=False)
    for sample in samples:
        got = needle._locate(tokenizer, document, sample)
        text = tokenizer.decode(prompt[got.start - 1 : got.end + 1])
        assert sample.answer in text
        assert got.end - got.start <= len(sample.answer) + 1
        assert abs(got.start / len(prompt) - sample.depth) < 0.12


def test_every_needle_is_selected_when_every_block_is(folder, tokenizer, tmp_path):
    """top-k past the document's block count: each layer attends every block, so each needle's
    block is among those chosen."""
    wide = tmp_path / "wide"
    shutil.copytree(folder, wide)
    config = json.loads((wide / "config.json").read_text())
    config["sparse_config"]["topk"] = 64  # > 2600 / 64 blocks
    (wide / "config.json").write_text(json.dumps(config))
    result = needle.run(load_model(wide), tokenizer, [SPARSE], DEPTHS, progress=print)
    assert all(all(r["selected"].values()) for r in result["rows"])


def test_a_needle_says_whether_its_value_ends_its_sentence(tokenizer):
    tasks = TaskGenerator(tokenizer, split=EVAL)
    places = {}
    for index in range(12):
        samples = tasks.needle_document(index, 1500, [0.2, 0.5, 0.8])
        for sample in samples:
            got = needle._locate(tokenizer, samples[0].document, sample)
            sentence = next(
                line for line in samples[0].document.replace(". ", ".\n").splitlines()
                if sample.answer in line
            )  # fmt: skip
            assert (got.place == "value last") == sentence.rstrip().endswith(sample.answer + ".")
            places.setdefault(got.place, sentence)
    assert set(places) == set(needle.PLACES), places  # the held-out facts have both kinds


def test_table_names_every_cell(result):
    text = needle.table(result)
    assert "accuracy by depth" in text and "needle block selected" in text
    assert "95 % interval" in text and f"/{len(DEPTHS)}" in text  # each context's right answers
    assert "value last" in text and "value before its key" in text
    assert f"{SPARSE:>8}" in text and "20%" in text and "80%" in text


def test_the_interval_holds_the_share_and_narrows_with_more_needles():
    assert needle.wilson(0, 10)[0] == 0 and needle.wilson(10, 10)[1] == 1
    low, high = needle.wilson(60, 100)
    assert 0.50 < low < 0.51 and 0.69 < high < 0.70
    narrow = needle.wilson(600, 1000)
    assert low < narrow[0] < 0.6 < narrow[1] < high


def test_cli_writes_json_and_heatmap(folder, tmp_path):
    out = tmp_path / "needle.json"
    args = ["bench", "needle", "--model", str(folder), "--contexts", str(DENSE)]
    got = CliRunner().invoke(main, [*args, "--depths", "50", "--out", str(out)])
    assert got.exit_code == 0, got.output
    saved = json.loads(out.read_text())
    assert saved["bench"] == "needle" and saved["model"] == str(folder)
    assert [(c["context"], c["depth"]) for c in saved["grid"]] == [(DENSE, 0.5)]
    assert (tmp_path / "needle.png").stat().st_size > 0


def test_a_context_too_short_for_its_needles_is_refused(folder):
    """--contexts 1 ran a ~260-token document and reported its rows as context 1."""
    args = ["bench", "needle", "--model", str(folder), "--contexts", "1", "--depths", "10,90"]
    got = CliRunner().invoke(main, args)
    assert got.exit_code == 2 and "1 tokens hold no document with 2 needles" in got.output


@pytest.mark.parametrize(
    "text, want",
    [("10..90", [0.1, 0.3, 0.5, 0.7, 0.9]), ("25,75", [0.25, 0.75]), ("0..0", [0.0])],
)
def test_depths_option(text, want):
    from salabatch.cli.bench import _depths

    assert _depths(text) == pytest.approx(want)


@pytest.mark.parametrize("text", ["abc", "10,150", "90..10"])
def test_bad_depths_are_refused(folder, text):
    got = CliRunner().invoke(main, ["bench", "needle", "--model", str(folder), "--depths", text])
    assert got.exit_code == 2 and "--depths" in got.output
