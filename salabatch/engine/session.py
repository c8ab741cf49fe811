"""One model, one prompt: what `salabatch generate` runs. Loads a checkpoint (or builtin:tiny)
with its tokenizer, prefills the chat prompt and streams the answer, with timings."""

from __future__ import annotations

import time
from collections.abc import Callable

from salabatch.engine.chat import THINK_CLOSE, THINK_OPEN, split_thinking
from salabatch.engine.generate import Generator, Request
from salabatch.engine.load import load_model
from salabatch.engine.model import Model
from salabatch.engine.models import resolve_model
from salabatch.engine.runtime import engine_runtime
from salabatch.engine.sampling import SamplingParams
from salabatch.engine.tokenizer import Tokenizer, load_tokenizer


def open_model(ref: str, dtype: str | None = None, cache_dir=None) -> tuple[Model, Tokenizer]:
    """A checkpoint folder or `builtin:tiny` → (model, tokenizer)."""
    path = resolve_model(ref, cache_dir)
    return load_model(path, dtype=dtype), load_tokenizer(path)


class AnswerStream:
    """Turns streamed text into what to show: everything with `think`, else the text after a
    leading <think>…</think> block (held back until it closes, or shown if there is none)."""

    def __init__(self, think: bool) -> None:
        self.think, self.text, self.shown = think, "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.think:
            return self._emit(self.text)
        head = self.text.lstrip()
        if THINK_OPEN.startswith(head) or (head.startswith(THINK_OPEN) and THINK_CLOSE not in head):
            return ""  # maybe, or surely, inside a think block: wait
        return self._emit(split_thinking(self.text)[1] if head.startswith(THINK_OPEN) else head)

    def _emit(self, visible: str) -> str:
        new, self.shown = visible[self.shown :], len(visible)
        return new


def stream_answer(
    ref: str,
    prompt: str,
    *,
    system: str | None,
    think: bool,
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    dtype: str | None = None,
    prefill_chunk: int = 2048,
    write: Callable[[str], None] = print,
) -> dict:
    """Streams the answer through `write`; returns token counts and timings."""
    model, tok = open_model(ref, dtype)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    ids = tok.chat_prompt_ids(messages, think=think)
    detok, shown = tok.detokenizer(skip_special=True), AnswerStream(think)

    def on_token(_request, token: int) -> None:
        detok.add_token(token)
        if piece := shown.feed(detok.last_segment):
            write(piece)

    request = Request(
        "prompt",
        tuple(ids),
        SamplingParams(temperature, top_p, top_k, seed=seed),
        max_tokens,
        frozenset(tok.eos_ids),
    )
    start = time.perf_counter()
    with engine_runtime():
        (g,) = Generator(
            model, batch_size=1, prefill_chunk=prefill_chunk, on_token=on_token
        ).generate([request])
    detok.finalize()
    if piece := shown.feed(detok.last_segment):
        write(piece)
    return {
        "prompt_tokens": g.prompt_tokens,
        "prefill_tok_s": g.prompt_tokens / g.prefill_s if g.prefill_s else 0.0,
        "ttft_s": g.ttft_s,
        "completion_tokens": g.completion_tokens,
        "decode_tok_s": g.decode_tok_s,
        "finish_reason": g.finish_reason,
        "total_s": time.perf_counter() - start,
    }
