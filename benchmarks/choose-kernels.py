"""Which custom CUDA kernels to time `bench long` with: those whose parity passed
(`SALABATCH_CUDA_KERNELS` as `device-gpu.sh` logged it) and that won in `device-profile.py`'s
log beside the MLX ops they replace, each as its dispatcher uses it. Prints the list (comma-
separated) and, on stderr, each kernel's figures; `device-gpu.sh` keeps it on the machine so
that a later call there takes it as `KERNELS=auto`.

    python3 benchmarks/choose-kernels.py LOG

A kernel the profile did not time (a call cut short) stays in if its parity passed and it is
on by default, and out otherwise: nothing is switched on untimed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from salabatch.engine.kernels.attention import DEFAULT_CUDA_KERNELS

DEFAULT = tuple(DEFAULT_CUDA_KERNELS.split(","))
TIMED = re.compile(r"^(?P<name>.+?)\s+(?P<ms>[0-9.]+) ms")
STEP = re.compile(r"^decode step, (?P<name>.+?): +(?P<ms>[0-9.]+) ms")


def times(log: str) -> dict[str, float]:
    """Each timed line's name → ms (the last one where a name repeats)."""
    out = {}
    for line in log.splitlines():
        match = STEP.match(line) or TIMED.match(line)
        if match:
            out[match["name"].strip()] = float(match["ms"])
    return out


def contexts(t: dict[str, float]) -> list[int]:
    return sorted({int(k.split(":")[0]) for k in t if re.match(r"^\d+: ", k)})


def compare(t: dict[str, float], pairs: list[tuple[str, str]]) -> tuple[float, float] | None:
    """Sums of (kernel, MLX ops) over the pairs the log has both of, or None."""
    both = [(t[k], t[m]) for k, m in pairs if k in t and m in t]
    if not both:
        return None
    return sum(k for k, _ in both), sum(m for _, m in both)


def choose(log: str) -> list[str]:
    t = times(log)
    passed = re.findall(r"SALABATCH_CUDA_KERNELS=(\S+)", log)
    passed = passed[0].split(",") if passed else []
    ns = contexts(t)
    # the decode steps' context, as the profile ran them (32768 on a GPU)
    at = [m[1] for k in t if (m := re.match(r"8 lightning layer\(s\), (\d+ context)$", k))]
    at = at[0] if at else "32768 context"
    step = f"8 lightning layer(s), {at}"
    pairs = {
        "scores": [(f"{n}: stage 1 (select_blocks), block scores CUDA kernel",
                    f"{n}: stage 1 (select_blocks)") for n in ns],
        "stage2": [(f"{n}: stage 2, CUDA kernel, 4 queries a thread block, query in registers",
                    f"{n}: stage 2, {'masked' if n <= 65536 else 'gathered'} form") for n in ns],
        "gla": [("lightning layer, whole (8K chunk), recurrence CUDA kernel",
                 "lightning layer, whole (8K chunk)")],
        "decode": [(f"8 sparse layer(s), {at}", "8 sparse layer(s), selection as MLX ops")],
        "norm": [(step, "8 lightning layer(s), residual adds and norms as MLX ops")],
        "rows": [(step, "8 lightning layer(s), products as MLX ops")],
    }  # fmt: skip
    # where the decode steps were not reached, the products alone (the step's share of them)
    products = [(f"{r} row(s), {name} x8: rows kernel, 4 loads in flight",
                 f"{r} row(s), {name} x8: MLX matmul")
                for r in (1, 8) for name in ("attention out", "MLP down", "MLP gate+up", "head")]
    fallback = {"rows": products}  # fmt: skip
    chosen = []
    for kernel in passed:
        if kernel not in pairs:  # stage1: no MLX-op twin timed apart; on by default
            chosen.append(kernel)
            continue
        sums = compare(t, pairs[kernel])
        if sums is None and kernel in fallback:
            sums = compare(t, fallback[kernel])
        if sums is None:
            keep = kernel in DEFAULT
            print(f"{kernel}: not timed; {'kept (a default)' if keep else 'left out'}",
                  file=sys.stderr)  # fmt: skip
        else:
            keep = sums[0] < sums[1]
            print(f"{kernel}: {sums[0]:.3f} ms with it, {sums[1]:.3f} with the MLX ops: "
                  f"{'in' if keep else 'out'}", file=sys.stderr)  # fmt: skip
        if keep:
            chosen.append(kernel)
    return chosen


if __name__ == "__main__":
    print(",".join(choose(Path(sys.argv[1]).read_text())) or "none")
