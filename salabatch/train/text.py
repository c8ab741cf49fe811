"""The text of the synthetic documents: filler sentences from the word pools, facts placed among
them in paragraphs, a follow-up chat turn, and the small random choices every kind of sample
makes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from salabatch.train.pools import ADJECTIVES, NOUNS, PLACES, TIMES, VERBS

LINE_PER_SENTENCE = 0.25  # the share of documents with one sentence per line (as PDF text)
END_OF_TURN = "<|im_end|>"


def follow_up_turn(question: str, *, think: bool) -> str:
    """A later question of the chat, after an answer and its end of turn, up to where the next
    answer starts (the chat template's user and assistant turns)."""
    turn = f"\n<|im_start|>user\n{question}{END_OF_TURN}\n<|im_start|>assistant\n"
    return turn if think else turn + "<think>\n\n</think>\n\n"


def place_facts(
    rng: np.random.Generator, facts: list[str], filler: list[str], *, shuffle: bool
) -> tuple[str, list[float]]:
    """`facts` placed at random depths among the `filler` sentences (in a random order if
    `shuffle`, else in the order given), in paragraphs of 3 to 8 sentences; the text and the
    depth of each fact (0 = start, 1 = end), in the order given."""
    n = len(filler)
    slots = sorted(rng.integers(0, n + 1, len(facts)).tolist())
    order = rng.permutation(len(facts)) if shuffle else range(len(facts))
    sentences, depths = list(filler), [0.0] * len(facts)
    for shift, (slot, which) in enumerate(zip(slots, order, strict=True)):
        sentences.insert(slot + shift, facts[which])
        depths[which] = slot / max(n, 1)
    joint = "\n" if rng.random() < LINE_PER_SENTENCE else " "
    paragraphs, i = [], 0
    while i < len(sentences):
        size = int(rng.integers(3, 9))
        paragraphs.append(joint.join(sentences[i : i + size]))
        i += size
    return "\n\n".join(paragraphs), depths


def filler_sentence(rng: np.random.Generator, shapes: Sequence[str]) -> str:
    nouns = rng.permutation(len(NOUNS))[:2]
    adjs = rng.permutation(len(ADJECTIVES))[:2]
    time = pick(rng, TIMES)
    place = pick(rng, PLACES)
    return pick(rng, shapes).format(
        adj=ADJECTIVES[adjs[0]],
        adj2=ADJECTIVES[adjs[1]],
        noun=NOUNS[nouns[0]],
        noun2=NOUNS[nouns[1]],
        verb=pick(rng, VERBS),
        time=time,
        Time=time[0].upper() + time[1:],
        place=place,
        place_bare=place.removeprefix("the "),
        n=int(rng.integers(2, 400)),
        year=int(rng.integers(1890, 2024)),
        hour=int(rng.integers(1, 13)),
    )


def capital(text: str) -> str:
    return text[0].upper() + text[1:]


def pick(rng: np.random.Generator, items: Sequence):
    return items[int(rng.integers(len(items)))]


def distinct(rng: np.random.Generator, draw, n: int) -> list:
    """`n` different values of `draw()`."""
    out: list = []
    while len(out) < n:
        x = draw()
        if x not in out:
            out.append(x)
    return out
