"""`benchmarks/choose-kernels.py`, which picks the custom CUDA kernels a lent GPU's `bench long`
runs with from its parity and profile log: a kernel that passed and won is in, one that lost
or went untimed is out (an untimed default stays), a kernel that failed parity never in."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "choose-kernels.py"


def choose(log: str) -> list[str]:
    spec = importlib.util.spec_from_file_location("choose_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.choose(log)


LOG = """== SALABATCH_CUDA_KERNELS=stage1,scores,stage2,decode,gla,rows
32768: stage 1 (select_blocks), block scores CUDA kernel     5.000 ms  (first   0.10 s)
32768: stage 1 (select_blocks)                  9.000 ms  (first   0.10 s)
32768: stage 2, masked form                   19.000 ms  (first   0.10 s)     0.0 TFLOP/s
32768: stage 2, gathered form                 39.000 ms  (first   0.10 s)     0.0 TFLOP/s
32768: stage 2, CUDA kernel, 4 queries a thread block, query in registers 25.000 ms
131072: stage 2, masked form                  68.000 ms  (first   0.10 s)
131072: stage 2, gathered form                38.000 ms  (first   0.10 s)
131072: stage 2, CUDA kernel, 4 queries a thread block, query in registers 17.000 ms
lightning layer, whole (8K chunk), recurrence CUDA kernel     6.838 ms  (first   2.56 s)
lightning layer, whole (8K chunk)                5.683 ms  (first  33.30 s)
decode step, 8 sparse layer(s), 32768 context:     4.00 ms
"""


def test_winners_in_losers_and_the_untimed_out():
    # scores and stage 2 won (stage 2: 42 ms against masked 19 at 32K + gathered 38 at 128K),
    # gla lost, decode untimed against its MLX ops but a default, rows untimed: out
    assert choose(LOG) == ["stage1", "scores", "stage2", "decode"]


def test_the_rows_kernel_by_its_products_where_no_step_was_timed():
    products = (
        "1 row(s), MLP gate+up x8: MLX matmul      1.700 ms  (first   0.00 s)\n"
        "1 row(s), MLP gate+up x8: rows kernel, 4 loads in flight      0.900 ms  (first   0.0 s)\n"
    )
    assert choose(LOG + products)[-1] == "rows"
    step = "decode step, 8 lightning layer(s), 32768 context:     3.00 ms\n"
    mlx = "decode step, 8 lightning layer(s), products as MLX ops:     2.90 ms\n"
    assert "rows" not in choose(LOG + products + step + mlx)  # the step decides


def test_a_kernel_that_failed_parity_is_never_in():
    log = LOG.replace("stage1,scores,stage2,decode,gla,rows", "stage1,decode")
    assert choose(log) == ["stage1", "decode"]
    assert choose("no parity ran") == []
