"""The warm-up kinds made of symbols rather than text: token ids, no sentences (`data.py`
dispatches to them). Each trains one circuit that the text kinds need and that forms late when
it has to be found through language:

* `induction`: copying by content. Random digits and letters with a span repeated at a random
  later place; the targets are the repeat after its first symbol.
* `lookup`: finding by content (associative recall). Pairs of a key (two letters) and a value
  (four digits), then follow-up chat turns each asking one key, answered with its value. The
  key sits before the chat's fixed turn tokens, as a question does, so the model must carry it
  to the answer and find the pair with that key: the step a needle question needs, and the one
  the text kinds alone did not teach (benchmarks/HISTORY.md, "Stage 3").
"""

from __future__ import annotations

import numpy as np

from salabatch.engine.tokenizer import Tokenizer
from salabatch.errors import ConfigError
from salabatch.train.text import END_OF_TURN, follow_up_turn

INDUCTION_SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
DIGITS_ONLY = 0.5  # the share of induction samples drawn from the digits alone
LETTERS = "abcdefghijklmnopqrstuvwxyz"
KEY_LETTERS, VALUE_DIGITS = 2, 4
KEY = "{key}"  # where a turn's key goes: follow_up_turn(KEY) split there
MOST_ASKED = 6


def induction(tok: Tokenizer, rng: np.random.Generator, length: int) -> tuple[list, tuple]:
    """`length` random symbols; a span of 8 to length/4 of them from the first half repeated
    somewhere in the second half; targets: the repeat after its first symbol. Half of the
    samples use the ten digits only: there a symbol recurs every ~10 tokens, so the copy must
    follow the symbols before it, not the last one alone (as a code's digits must)."""
    if length < 32:
        raise ConfigError("induction samples need a length of at least 32", got=length)
    alphabet = INDUCTION_SYMBOLS[:10] if rng.random() < DIGITS_ONLY else INDUCTION_SYMBOLS
    symbols = np.array([tok.token_id(c) for c in alphabet])
    ids = symbols[rng.integers(len(symbols), size=length)]
    span = int(rng.integers(8, length // 4 + 1))
    source = int(rng.integers(0, length // 2 - span + 1))
    copy = int(rng.integers(length // 2, length - span + 1))
    ids[copy : copy + span] = ids[source : source + span]
    return ids.tolist(), ((copy + 1, copy + span),)


def lookup(tok: Tokenizer, rng: np.random.Generator, length: int) -> tuple[list, tuple]:
    """Key-value pairs ("qx 4821;") filling about `length` tokens with their questions, then
    up to MOST_ASKED turns each asking a different key; targets: each value and its end of
    turn."""
    ask, answer = (
        tok.encode(part, special=True) for part in follow_up_turn(KEY, think=False).split(KEY)
    )
    pair = KEY_LETTERS + VALUE_DIGITS + 2  # key, space, value, ';'
    turn = len(ask) + KEY_LETTERS + len(answer) + VALUE_DIGITS + 1
    n_pairs = (length - MOST_ASKED * turn) // pair
    if n_pairs < 2:
        raise ConfigError("lookup samples need a length of at least 300", got=length)
    letters = [tok.token_id(c) for c in LETTERS]
    digits = [tok.token_id(c) for c in "0123456789"]
    (space,), (semicolon,) = tok.encode(" ", special=False), tok.encode(";", special=False)
    eot = tok.token_id(END_OF_TURN)
    keys = rng.choice(len(LETTERS) ** KEY_LETTERS, n_pairs, replace=False)
    key_ids = [[letters[k // len(LETTERS) ** i % len(LETTERS)] for i in (1, 0)] for k in keys]
    values = rng.integers(0, 10, (n_pairs, VALUE_DIGITS))
    ids: list[int] = []
    for key, value in zip(key_ids, values, strict=True):
        ids += [*key, space, *(digits[d] for d in value), semicolon]
    targets = []
    for i in rng.permutation(n_pairs)[: min(MOST_ASKED, n_pairs)]:
        ids += ask + key_ids[i] + answer
        targets.append((len(ids), len(ids) + VALUE_DIGITS + 1))
        ids += [digits[d] for d in values[i]] + [eot]
    return ids, tuple(targets)
