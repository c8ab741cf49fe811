"""Streaming decode: the text of a growing token sequence, emitted as soon as it is stable."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _Backend

from salabatch.errors import TokenizerError

# Tokens of the text before the answer decoded with its first ones: enough for a decoder that
# strips a leading space, or merges a character split over byte tokens, to see its neighbours.
CONTEXT_TOKENS = 5


class StreamingDetokenizer:
    """Text of a growing token sequence, emitted as soon as it is stable.

    Each token decodes a short window: the tokens of the last emitted piece (context, so that
    decoders which strip a leading space see the same neighbour as in a full decode) plus those
    added since; what the window adds to the context's text is the new piece. A window whose
    text ends in U+FFFD (a character split across byte tokens) is held until the character
    completes or `finalize()` is called. Byte tokens that never make a character (a stray
    continuation byte, a cut-off sequence) decode to U+FFFD, as `Tokenizer.decode` gives them:
    a model's answer never fails to decode. Cost per token: two decodes of a few tokens.

    `after`: the tokens the answer continues (a text completion's prompt): its first tokens
    decode after the last `CONTEXT_TOKENS` of them (less those before the first whole
    character), so that their text is what they add to the prompt's, leading space included;
    they are not part of `text` nor of `tokens`.

    Made by `Tokenizer.detokenizer()`: `backend` is its tokenizers backend, `path` the file it
    was read from (named by a TokenizerError).
    """

    def __init__(
        self,
        backend: _Backend,
        path: Path,
        *,
        skip_special: bool = False,
        after: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self._skip = skip_special
        self._path = path
        self._after = self._context([int(t) for t in after[len(after) - CONTEXT_TOKENS :]])
        self.reset()

    def _context(self, tail: list[int]) -> list[int]:
        """The longest end of `tail` that decodes with the fewest U+FFFD: one that starts at a
        character, not inside one a byte-fallback run or a byte-level token split (ByteFallback
        turns a whole run of byte tokens to U+FFFD when any of it is no UTF-8, and the answer's
        first bytes would join that run)."""
        if not tail:
            return []
        spoiled = [self._decode(tail[i:]).count("\ufffd") for i in range(len(tail))]
        return tail[spoiled.index(min(spoiled)) :]

    def reset(self) -> None:
        self.tokens: list[int] = []  # the answer's
        self._ids = list(self._after)  # the context's, then the answer's
        self._start = 0  # the window: _ids[_start:_read] is the last emitted piece's tokens
        self._read = len(self._ids)
        self._chunks: list[str] = []
        self._unread: list[str] = []

    def add_token(self, token: int) -> None:
        self.tokens.append(int(token))
        self._ids.append(int(token))
        self._advance(final=False)

    def finalize(self) -> None:
        """Flush held-back text, U+FFFD included (the sequence ended mid-character).

        Call it once, when the sequence has ended.
        """
        if self._read < len(self._ids):
            self._advance(final=True)

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

    def _advance(self, *, final: bool) -> None:
        """Emit what the tokens since the last piece add to its text, unless it may still
        change (it ends mid-character) and more tokens are to come."""
        before = self._decode(self._ids[self._start : self._read])
        now = self._decode(self._ids[self._start :])
        if not final and (len(now) <= len(before) or now.endswith("\ufffd")):
            return
        self._emit(now[len(before) :])
        self._start, self._read = self._read, len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        try:
            return self._backend.decode(ids, skip_special_tokens=self._skip)
        except Exception as e:  # the Rust side raises a bare Exception (an id out of range)
            raise TokenizerError(f"streaming decode failed: {e}", path=self._path) from e

    def _emit(self, piece: str) -> None:
        if piece:
            self._chunks.append(piece)
            self._unread.append(piece)
