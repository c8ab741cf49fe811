"""Constrained decoding: answers that must match a JSON schema, any JSON object or a regular
expression (OpenAI's `response_format`), on outlines-core's token index.

A `Grammar` is a pattern compiled against a tokenizer's vocabulary: for each state of the
pattern's automaton, the tokens whose bytes keep the text inside the pattern. Compiling is the
costly part (a specific schema takes milliseconds, "any JSON object" about 5 s on a 57K-token one),
so `Grammars` compiles each pattern once per tokenizer and keeps it, in a child process bounded
in time and memory (`grammar_compile`: a small pattern can take exponential time and memory). A
row holds its own `Guide` (its state in the automaton): a `generate.Batch` reads the row's
newest token, advances the guide past it, and draws the next token among those the guide allows
(`allowed_tokens`, a mask on the logits before penalties, temperature and truncation). Special
tokens are never allowed, but the end token once the pattern is complete: nothing else is, so
the row stops there. An answer cut by max_tokens may stop inside the pattern (finish_reason
`length`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from outlines_core import Guide, Index, Vocabulary

from salabatch.engine.grammar_compile import (
    COMPILE_BYTES,
    COMPILE_SECONDS,
    CompileError,
    compile_index,
)
from salabatch.errors import GenerationError
from salabatch.structure import ANY_OBJECT, schema_pattern

CACHED = 32  # compiled grammars `Grammars` keeps, the least recently used dropped first
END_TOKEN = "<|im_end|>"  # the end a chat answer's grammar allows, where it is an eos token
# What the end token spells in a grammar's vocabulary, and each pattern ends with: outlines-core
# (0.2.14) lets a state where the pattern is complete go on only into states where it is still
# complete (after "1" of `1(\.5)?` only the end: never "1.5"), so no state before the pattern's
# own end is made complete, by a character only the end token spells: U+10FFFD (private use);
# no other token may hold its first byte, 0xF4, which only the 16th plane's characters hold. A
# pattern may hold that character itself (`.`, a JSON string's), so the end token is allowed
# only where it leads to the complete state (`Grammar.complete`), never as that character.
SENTINEL = "\U0010fffd"


@dataclass(frozen=True)
class Grammar:
    """A pattern compiled against a vocabulary; `guide()` is a new row's state in it."""

    pattern: str  # the regular expression
    index: Index
    end: int  # the token allowed once the pattern is complete, and only then: the answer's end

    def guide(self) -> Guide:
        return Guide(self.index)

    def complete(self, state: int) -> bool:
        """Whether the pattern is complete in `state` (the end token leads to a final state)."""
        after = self.index.get_next_state(state, self.end)
        return after is not None and self.index.is_final_state(after)


class Grammars:
    """The grammars of one tokenizer (`Tokenizer.grammars` makes them), each compiled once
    (thread-safe: a server compiles them in worker threads). The vocabulary maps every token's
    bytes (`Tokenizer.token_bytes`) to its ids, less the added tokens; the end is the eos token
    `<|im_end|>` where the tokenizer has it (a chat answer ends with it), else its first eos
    token. One pattern compiles at a time (each may take `max_bytes`), for at most `seconds`."""

    def __init__(
        self,
        tok,  # a Tokenizer (its `grammars`)
        cached: int = CACHED,
        seconds: float = COMPILE_SECONDS,
        max_bytes: int = COMPILE_BYTES,
    ) -> None:
        self.tok, self.cached, self.end = tok, cached, answer_end(tok)
        self.seconds, self.max_bytes = seconds, max_bytes
        self._vocabulary: Vocabulary | None = None
        # pattern -> its grammar, or why it cannot be compiled (a GenerationError's message)
        self._held: OrderedDict[str, Grammar | str] = OrderedDict()
        self._compiling: dict[str, threading.Lock] = {}  # one thread compiles a pattern
        self._lock = threading.Lock()
        self._compile = threading.Lock()  # one compile at a time

    def json_schema(self, schema: dict, field: str = "response_format") -> Grammar:
        """The grammar of JSON text that `schema` validates (GenerationError naming `field`
        for a schema outlines-core cannot turn into a pattern)."""
        try:
            pattern = schema_pattern(schema)
        except ValueError as e:
            raise GenerationError(str(e), field=field) from None
        return self.regex(pattern, field)

    def json_object(self) -> Grammar:
        """Any JSON object (objects nested 3 deep at most)."""
        return self.json_schema(ANY_OBJECT)

    def regex(self, pattern: str, field: str = "response_format") -> Grammar:
        """The grammar of text that `pattern` matches whole. Threads asking for a pattern while
        another compiles it wait for that one (a server's first requests with one schema)."""
        with self._lock:
            gate = self._compiling.setdefault(pattern, threading.Lock())
        with gate:
            with self._lock:
                held = self._held.get(pattern)
                if held is None:
                    vocabulary = self._vocabulary = self._vocabulary or self._vocabulary_of()
            if held is None:
                try:
                    whole = f"(?:{pattern}){SENTINEL}"
                    with self._compile:
                        index = compile_index(whole, vocabulary, self.seconds, self.max_bytes)
                    held = Grammar(pattern, index, self.end)
                except CompileError as e:
                    held = f"the pattern cannot be used: {e}"
            with self._lock:
                self._held[pattern] = held
                self._held.move_to_end(pattern)
                while len(self._held) > self.cached:
                    self._held.popitem(last=False)
                self._compiling.pop(pattern, None)
        if isinstance(held, str):
            raise GenerationError(held, field=field)
        return held

    def _vocabulary_of(self) -> Vocabulary:
        """Every token's bytes but the added tokens' and those holding 0xF4; the end token
        spells SENTINEL only. The vocabulary's eos, which only the state after SENTINEL allows (no
        row gets there: the end token ends it), is an id past the tokenizer's."""
        tok, end = self.tok, self.end
        added = set(tok.backend.get_added_tokens_decoder())
        pieces: dict[bytes, list[int]] = {SENTINEL.encode(): [end]}
        for token in range(tok.vocab_size):
            piece = tok.token_bytes(token)
            if token not in added and token != end and piece and b"\xf4" not in piece:
                pieces.setdefault(piece, []).append(token)
        return Vocabulary(tok.vocab_size, pieces)


def answer_end(tok) -> int:
    """The token that ends a chat answer: the eos token `<|im_end|>` where the tokenizer (a
    Tokenizer) has it, else its first eos token."""
    ends = sorted(tok.eos_ids)
    return next((t for t in ends if tok.backend.id_to_token(t) == END_TOKEN), ends[0])


def allowed_tokens(rows: Sequence[tuple[Guide, Grammar] | None], vocab: int) -> mx.array:
    """[B, vocab] bool: the tokens each row's guide (in its grammar) allows next, the end token
    only where the pattern is complete; every token in a row without one. The guides write bit
    masks on the host (one bit per token); they are unpacked here."""
    words = (vocab + 31) // 32
    bits = np.full((len(rows), words), -1, dtype=np.int32)
    flags = bits.view(np.uint32)
    for b, row in enumerate(rows):
        if row is None:
            continue
        guide, grammar = row
        guide.write_mask_into(bits[b].ctypes.data, words, 4)
        word, bit = divmod(grammar.end, 32)
        if flags[b, word] >> bit & 1 and not grammar.complete(guide.get_state()):
            flags[b, word] &= np.uint32(~(1 << bit) & 0xFFFFFFFF)  # the end as a character
    token = mx.arange(vocab)
    word = mx.array(bits)[:, token // 32]
    return ((word >> (token % 32).astype(mx.int32)) & 1).astype(mx.bool_)
