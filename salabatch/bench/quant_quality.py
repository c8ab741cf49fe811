"""What quantization costs a model in answers: 8-bit and 4-bit (MLX affine, bf16 scales, as
`salabatch convert` makes them; groups of 64, its default, or of 32 for `4bit-g32`; `4bit-h8`
keeps lm_head at 8 bits, `convert --head-bits 8`) against float32 on the same needle set.

For each format, the needle documents of `bench needle` (held-out facts at known depths, asked as
one batch over each document's prefix) are answered greedily; a format's `agreement` is the share
of needles it answers exactly as float32 does, its `accuracy` the share it answers right. Beside
them, `logit_rel_rms`: over held-out needle samples, the logits at every answer position (after
the true prefix, as training scores them), ‖quantized − float32‖ / ‖float32‖ over all of them.
Activations stay float32, so what differs is the weights alone. Random weights say little here
(their 4-bit error is ~9 % per matrix whatever the code does): this is for a trained model.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from salabatch.bench import needle
from salabatch.bench.quant import parse_format

# {bits}bit[-g{group size}][-h{lm_head bits}]: groups of 64 and the head at `bits` unless named;
# the defaults (any format of that form runs)
FORMATS = ("8bit", "4bit", "4bit-g32", "4bit-h8")
LOGIT_SAMPLES = 16
LOGIT_LENGTH = 1024


def run(
    model_ref: str,
    formats: Sequence[str] = FORMATS,
    contexts: Sequence[int] = (4096,),
    depths: Sequence[float] = needle.DEPTHS,
    *,
    documents: int = 2,
    seed: int = 0,
    chunk: int = 2048,
    logit_samples: int = LOGIT_SAMPLES,
    logit_length: int = LOGIT_LENGTH,
    progress: Callable[[str], None] = print,
) -> dict:
    """A row per format (float32 first): accuracy, agreement with float32, logit relative RMS,
    and the needles' answers."""
    from salabatch.engine.load import load_model
    from salabatch.engine.quantize import convert
    from salabatch.engine.tokenizer import load_tokenizer
    from salabatch.models import resolve_model

    parsed = {fmt: parse_format(fmt) for fmt in formats}  # a ConfigError before any work
    src = resolve_model(model_ref)
    tokenizer = load_tokenizer(src)
    samples = _logit_samples(tokenizer, seed, logit_samples, logit_length)
    rows, reference, ref_logits, values = [], None, None, []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("float32", *formats):
            path = src
            if fmt != "float32":
                path = Path(tmp) / fmt
                bits, group_size, head_bits = parsed[fmt]
                convert(
                    src,
                    path,
                    bits=bits,
                    group_size=group_size,
                    head_bits=head_bits,
                    dtype="bfloat16",
                    progress=False,
                )
            model = load_model(path, dtype="float32")
            progress(f"quant quality: {fmt} …")
            result = needle.run(
                model, tokenizer, contexts, depths, documents=documents, seed=seed, chunk=chunk,
                progress=progress,
            )  # fmt: skip
            answers = [r["answer"].strip() for r in result["rows"]]
            logits = _answer_logits(model, samples)
            if reference is None:  # float32, the first
                reference, ref_logits = answers, logits
                values = [r["value"] for r in result["rows"]]
            same = sum(a == b for a, b in zip(answers, reference, strict=True))
            rows.append(
                {
                    "format": fmt,
                    "accuracy": result["accuracy"],
                    "agreement": round(same / len(reference), 4),
                    "logit_rel_rms": round(_rel_rms(logits, ref_logits), 6),
                    "answers": answers,
                }
            )
            del model
    return {
        "model": str(model_ref),
        "contexts": list(contexts),
        "depths": list(depths),
        "documents": documents,
        "needles": len(values),
        "logit_samples": len(samples),
        "logit_length": logit_length,
        "values": values,
        "results": rows,
    }


def table(result: dict) -> str:
    lines = [f"{'format':>11} | {'accuracy':>8} {'agreement':>9} {'logit rel RMS':>13}"]
    for r in result["results"]:
        lines.append(
            f"{r['format']:>11} | {r['accuracy']:>8.1%} {r['agreement']:>9.1%} "
            f"{r['logit_rel_rms']:>13.2e}"
        )
    lines.append(
        f"\n{result['needles']} needles (contexts {result['contexts']}), logits over "
        f"{result['logit_samples']} held-out samples of {result['logit_length']} tokens"
    )
    return "\n".join(lines)


def _logit_samples(tokenizer, seed: int, n: int, length: int) -> list:
    from salabatch.train.data import EVAL, TaskGenerator
    from salabatch.train.scoring import make_batch

    tasks = TaskGenerator(tokenizer, split=EVAL, seed=seed, kinds=("needle",))
    return [make_batch([tasks.encoded(i, length)], pad_id=2) for i in range(n)]


def _answer_logits(model, batches: list) -> list[mx.array]:
    from salabatch.train.scoring import answer_logits

    out = []
    for batch in batches:  # one sample each
        kept = mx.array(np.flatnonzero(np.array(batch.mask[0])))
        logits = answer_logits(model, batch)[0, kept]  # [answer tokens, vocab]
        mx.eval(logits)
        out.append(logits)
    return out


def _rel_rms(logits: list[mx.array], reference: list[mx.array]) -> float:
    diff = sum(float(((a - b) ** 2).sum()) for a, b in zip(logits, reference, strict=True))
    norm = sum(float((b**2).sum()) for b in reference)
    return (diff / norm) ** 0.5
