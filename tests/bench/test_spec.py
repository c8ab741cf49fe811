"""`salabatch bench spec`: its rows, ratios and table on one small workload. It measures nothing
here; the numbers live in benchmarks/README.md."""

from __future__ import annotations

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
    table = spec.table(result)
    assert "extraction" in table and "lookup" in table and "yes" in table
