"""`salabatch bench long` end to end on tiny shapes (sparse from 256 tokens): its rows, ratios,
table, JSON and chart. It measures nothing here; the numbers live in benchmarks/."""

from __future__ import annotations

import json

import pytest

from salabatch.bench import long
from tests.tiny import SPARSE_AT_256, tiny_config_dict

TINY = long.Shapes(
    "tiny",
    tiny_config_dict(**SPARSE_AT_256),
    long._llama(64, 4, 8, 2, 8, 128, 256, 1e4),
)


@pytest.fixture(scope="module")
def result():
    pytest.importorskip("mlx_lm", reason="the dense peer needs mlx-lm (salabatch[bench])")
    return long.run([200, 700], shapes=TINY, batch=3, steps=2, chunk=256, progress=lambda _: None)


def test_rows_for_both_models_at_every_context(result):
    got = [(r["model"], r["context"]) for r in result["results"]]
    assert got == [("sala", 200), ("sala", 700), ("peer", 200), ("peer", 700)]
    for r in result["results"]:
        assert r["prefill_s"] > 0 and r["decode_b1_tok_s"] > 0 and r["peak_gb"] > 0
        assert ("decode_b3_tok_s" in r) == (r["model"] == "sala")


def test_rows_report_the_hosts_part_of_a_decode_step(result):
    for r in result["results"]:
        assert 0 < r["decode_b1_host_ms"] <= 1e3 / r["decode_b1_tok_s"]


def test_rows_report_decode_as_a_generation_loop_runs_it(result):
    rows = {(r["model"], r["context"]): r for r in result["results"]}
    for r in result["results"]:
        assert r["decode_b1_pipelined_tok_s"] > 0
    for ratio in result["ratios"]:
        s, p = rows["sala", ratio["context"]], rows["peer", ratio["context"]]
        want = s["decode_b1_pipelined_tok_s"] / p["decode_b1_pipelined_tok_s"]
        # rounded to 2 decimals: ±0.005, more than 1 % of a ratio under 0.5
        assert ratio["decode_b1_pipelined_speedup"] == pytest.approx(want, rel=0.01, abs=0.006)


def test_sala_is_measured_fused_as_load_model_leaves_it():
    """The decode step takes the fused projections `load_model` makes; a model left unfused
    would run each projection on its own, as no user's does."""
    import mlx.core as mx

    model = long.build("sala", TINY, mx.float32)
    assert all(layer.mlp.fused is not None for layer in model.layers)
    assert all(layer.self_attn.fused is not None for layer in model.layers)


def test_sala_is_measured_within_its_memory_plan_unless_told_not(monkeypatch):
    """As `salabatch run` holds a document: MLX's limit at SALA's plan for each context (the
    peer as mlx-lm runs); `bound=False` (`--no-bound`) measures without it, side by side."""
    from contextlib import contextmanager

    from salabatch.engine import memory

    plans = []
    bounded = memory.bounded

    @contextmanager
    def recorded(plan):
        plans.append(plan)
        with bounded(plan) as limit:
            yield limit

    monkeypatch.setattr(memory, "bounded", recorded)
    run = long.run([300], shapes=TINY, batch=2, steps=2, chunk=256, peer=False, progress=print)
    assert run["memory_bound"] and len(plans) == 1 and plans[0].document > 0
    free = long.run([300], shapes=TINY, batch=2, steps=2, chunk=256, peer=False, bound=False)
    assert not free["memory_bound"] and len(plans) == 1


def test_ratios_compare_like_with_like(result):
    rows = {(r["model"], r["context"]): r for r in result["results"]}
    for ratio in result["ratios"]:
        s, p = rows["sala", ratio["context"]], rows["peer", ratio["context"]]
        assert ratio["prefill_speedup"] == pytest.approx(p["prefill_s"] / s["prefill_s"], 0.01)
        assert ratio["b3_over_b1"] == pytest.approx(
            s["decode_b3_tok_s"] / s["decode_b1_tok_s"], 0.01
        )
    assert result["ratios"][0]["decode_vs_shortest"] == 1.0
    for ratio in result["ratios"]:  # > 1 favours SALA, as every ratio here
        s, p = rows["sala", ratio["context"]], rows["peer", ratio["context"]]
        assert ratio["peak_memory_saving"] == pytest.approx(p["peak_gb"] / s["peak_gb"], abs=0.006)


def test_command_writes_table_json_and_chart(tmp_path, monkeypatch):
    pytest.importorskip("mlx_lm", reason="the dense peer needs mlx-lm (salabatch[bench])")
    pytest.importorskip("matplotlib", reason="the chart needs matplotlib (salabatch[bench])")
    from click.testing import CliRunner

    from salabatch.cli import main

    monkeypatch.setitem(long.SHAPES, "small", TINY)  # the CPU default, shrunk
    out = tmp_path / "long.json"
    run = CliRunner().invoke(
        main,
        ["bench", "long", "--contexts", "300", "--steps", "2", "--batch", "2", "--out", str(out)],
    )
    assert run.exit_code == 0, run.output
    assert "prefill s SALA" in run.output and "300" in run.output
    data = json.loads(out.read_text())
    assert data["bench"] == "long" and data["device"] and data["ratios"]
    png = out.with_suffix(".png").read_bytes()
    assert png.startswith(b"\x89PNG")


def test_without_mlx_lm_the_error_says_how_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mlx_lm(name, *args, **kwargs):
        if name.startswith("mlx_lm"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlx_lm)
    with pytest.raises(Exception, match="mlx-lm"):
        long.build("peer", TINY, None)


def test_a_run_cut_short_keeps_what_it_measured(tmp_path, monkeypatch):
    """The JSON is written after every measurement; without matplotlib the chart is a note."""
    import builtins

    from click.testing import CliRunner

    from salabatch.cli import main

    monkeypatch.setitem(long.SHAPES, "small", TINY)
    real_measure, real_import = long.measure, builtins.__import__
    out = tmp_path / "long.json"

    def measure(kind, *args):
        if kind == "peer":  # the run dies after SALA's rows (a device's time limit, say)
            assert [r["model"] for r in json.loads(out.read_text())["results"]] == ["sala"] * 2
            raise TimeoutError("the device's time limit")
        return real_measure(kind, *args)

    monkeypatch.setattr(long, "measure", measure)
    argv = ["bench", "long", "--contexts", "200,300", "--steps", "1", "--batch", "2"]
    run = CliRunner().invoke(main, [*argv, "--out", str(out)])
    assert run.exit_code == 1 and "TimeoutError: the device's time limit" in run.output
    kept = json.loads(out.read_text())
    assert [r["context"] for r in kept["results"]] == [200, 300] and kept["ratios"]

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    run = CliRunner().invoke(main, [*argv, "--no-peer", "--out", str(out)])
    assert run.exit_code == 0, run.output
    assert "no chart: matplotlib is not installed" in run.output
    assert not out.with_suffix(".png").exists()
