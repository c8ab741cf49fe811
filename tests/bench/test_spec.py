"""`salabatch bench spec`: its rows, ratios and table on one small workload. It measures nothing
here; the numbers live in benchmarks/README.md."""

from __future__ import annotations

import pytest

from salabatch.bench import spec


def test_spec_bench_rows_ratios_and_table():
    result = spec.run(workloads=("extraction",), batches=(8,), drafts=("off", "lookup"), rounds=2)
    rows = result["rows"]
    assert [(r["workload"], r["batch"], r["draft"]) for r in rows] == [
        ("extraction", 8, "off"),
        ("extraction", 8, "lookup"),
    ]
    off, lookup = rows
    assert off["vs_off"] == 1.0 and off["drafted"] == 0
    # the ratio is the median of the rounds' own (each round's settings side by side)
    assert len(lookup["vs_off_rounds"]) == 2 == len(lookup["tok_s_rounds"])
    assert abs(lookup["vs_off"] - sum(lookup["vs_off_rounds"]) / 2) <= 0.001
    assert lookup["drafted"] > 0 and 0 <= lookup["accepted"] <= lookup["drafted"]
    assert lookup["same_answers"] is True  # greedy: speculation changes no answer
    assert lookup["tokens"] == off["tokens"] > 0
    (cost,) = result["pass_cost"]  # a verify pass against plain steps, beside the rows
    assert cost["workload"] == "extraction" and cost["batch"] == 8 and cost["pass_steps"] > 0
    table = spec.table(result)
    assert "extraction" in table and "lookup" in table and "yes" in table
    assert "extraction, batch 8: a verify pass of 5 positions" in table


def test_pass_cost_times_a_verify_pass_against_plain_steps(tmp_path):
    """`pass_cost` on a tiny checkpoint: both times measured, their ratio reported, and the
    document's cache left as it was (the rows are its forks)."""
    from salabatch.engine.load import load_model
    from tests.tiny import tiny_config_dict, write_tiny_checkpoint

    model = load_model(write_tiny_checkpoint(tmp_path, tiny_config_dict()), dtype="float32")
    doc = tuple(range(3, 200))
    prefix = spec._prefilled(model, doc)
    cost = spec.pass_cost(model, prefix, batch=2, tokens=3, steps=6)
    assert prefix.offset == len(doc)  # the rows were forks
    assert cost["batch"] == 2 and cost["positions"] == 4
    assert cost["step_ms"] > 0 and cost["pass_ms"] > 0
    ratio = cost["pass_ms"] / cost["step_ms"]  # of the rounded times: within their rounding
    assert cost["pass_steps"] == pytest.approx(ratio, rel=0.02, abs=0.01)
    line = spec.table({"rows": [], "pass_cost": [{"workload": "cost", **cost}]})
    assert "a verify pass of 4 positions" in line and "plain steps" in line


def test_cost_workload_refuses_unknown_shapes():
    with pytest.raises(ValueError, match="shapes must be one of"):
        spec._workload("cost", shapes="70b")
