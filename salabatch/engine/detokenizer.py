"""Streaming decode: the text of a growing token sequence, emitted as soon as it is stable."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _Backend
from tokenizers.decoders import DecodeStream

from salabatch.errors import TokenizerError


class StreamingDetokenizer:
    """Text of a growing token sequence, emitted as soon as it is stable.

    The backend's `DecodeStream` decodes a short window per token: the tokens of the last
    emitted piece (context, so that decoders which strip a leading space see the same neighbour
    as in a full decode) plus the new ones. Text ending in U+FFFD (an incomplete UTF-8 character
    split across byte tokens) is held back until the character completes or `finalize()` is
    called. Cost per token is O(window), constant in practice.

    Made by `Tokenizer.detokenizer()`: `backend` is its tokenizers backend, `path` the file it
    was read from (named by a TokenizerError).
    """

    def __init__(self, backend: _Backend, path: Path, *, skip_special: bool = False) -> None:
        self._backend = backend
        self._skip = skip_special
        self._path = path
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        self._held = 0  # tokens added since the last emitted piece
        self._chunks: list[str] = []
        self._unread: list[str] = []

    def add_token(self, token: int) -> None:
        self.tokens.append(int(token))
        try:
            piece = self._stream.step(self._backend, self.tokens[-1])
        except Exception as e:  # the Rust side raises a bare Exception
            raise TokenizerError(f"streaming decode failed: {e}", path=self._path) from e
        if piece is None:
            self._held += 1
        else:
            self._held = 0
            self._emit(piece)

    def finalize(self) -> None:
        """Flush held-back text, U+FFFD included (the sequence ended mid-character).

        Call it once, when the sequence has ended.
        """
        if self._held:
            full = self._backend.decode(self.tokens, skip_special_tokens=self._skip)
            self._emit(full[len(self.text) :])
            self._held = 0

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
