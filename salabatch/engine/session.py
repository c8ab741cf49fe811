"""One prompt on a loaded model: what `salabatch generate` shows. The answer streams through
`salabatch.api.stream_generate`, a leading <think> block hidden unless asked for, and the
timings come back for the summary line."""

from __future__ import annotations

import time
from collections.abc import Callable

from salabatch.api import stream_generate
from salabatch.engine.chat import THINK_CLOSE, THINK_OPEN, split_thinking
from salabatch.engine.model import Model
from salabatch.engine.tokenizer import Tokenizer


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

    def finish(self) -> str:
        """What is left to show once the stream has ended: text held back because it might
        have started <think> ("<", "<th"; an answer that only began like one), or the answer
        after a think block that never closed (`split_thinking`'s reading of it)."""
        if self.think:
            return ""
        head = self.text.lstrip()
        return self._emit(split_thinking(self.text)[1] if head.startswith(THINK_OPEN) else head)

    def _emit(self, visible: str) -> str:
        new, self.shown = visible[self.shown :], len(visible)
        return new


def stream_answer(
    model: Model,
    tok: Tokenizer,
    prompt: str,
    *,
    think: bool,
    write: Callable[[str], None] = print,
    **settings,
) -> dict:
    """Streams the answer through `write` (`settings`: those of `stream_generate`); returns
    token counts and timings."""
    shown = AnswerStream(think)
    start = time.perf_counter()
    first_at = None
    for r in stream_generate(model, tok, prompt, think=think, **settings):
        first_at = first_at or time.perf_counter()
        if piece := shown.feed(r.text):
            write(piece)
    if rest := shown.finish():
        write(rest)
    return {
        "prompt_tokens": r.prompt_tokens,
        "prefill_tok_s": r.prompt_tps,
        "ttft_s": first_at - start,
        "completion_tokens": r.generation_tokens,
        "decode_tok_s": r.generation_tps,
        "finish_reason": r.finish_reason,
        "total_s": time.perf_counter() - start,
    }
