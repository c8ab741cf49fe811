"""Streaming detokenization: the text of a growing token sequence, as soon as it is stable."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tokenizer.py imports this module
    from salabatch.engine.tokenizer import Tokenizer


class StreamingDetokenizer:
    """Text of a growing token sequence, emitted as soon as it is stable.

    Each step decodes only a window: the tokens emitted at the last clean step (context, so that
    decoders which strip a leading space see the same neighbour as in a full decode) plus the
    tokens since. Text ending in U+FFFD (an incomplete UTF-8 character split across byte
    tokens) is held back until the character completes or `finalize()` is called. Cost per
    token is O(window), constant in practice.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._decode = tokenizer.backend.decode
        self._skip = skip_special
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self._start = 0  # window start (token index)
        self._ctx_end = 0  # tokens [start, ctx_end) are context already emitted
        self._sent = 0  # chars of decode(tokens[start:]) already emitted
        self._chunks: list[str] = []
        self._unread: list[str] = []

    def add_token(self, token: int) -> None:
        self.tokens.append(int(token))
        text = self._decode(self.tokens[self._start :], skip_special_tokens=self._skip)
        if text.endswith("\ufffd"):
            # Emit what is certain; the tail may still become a character.
            stable = len(text.rstrip("\ufffd"))
            self._emit(text[self._sent : stable])
            self._sent = max(self._sent, stable)
            return
        self._emit(text[self._sent :])
        # Clean boundary: the tokens just emitted become the next window's context.
        self._start, self._ctx_end = self._ctx_end, len(self.tokens)
        ctx = self._decode(self.tokens[self._start :], skip_special_tokens=self._skip)
        self._sent = len(ctx)

    def finalize(self) -> None:
        """Flush held-back text, U+FFFD included (the sequence ended mid-character)."""
        text = self._decode(self.tokens[self._start :], skip_special_tokens=self._skip)
        self._emit(text[self._sent :])
        self._sent = len(text)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def last_segment(self) -> str:
        """Text emitted since the last read of `last_segment`."""
        segment = "".join(self._unread)
        self._unread = []
        return segment

    def _emit(self, piece: str) -> None:
        if piece:
            self._chunks.append(piece)
            self._unread.append(piece)
