"""Synthetic long-document question answering: the training and evaluation tasks, no download.

The kinds of sample: each a document, a question whose answer is a span of it, and the
answer:

* `needle`: one fact ("The secret verification code for Project Aurora is 739258.") somewhere
  in filler text;
* `multi`: several facts plus distractors: the asked entity with other attributes and the asked
  attribute of other entities, each with its own value;
* `contract`: a contract-like document (parties, amount, dates, term, governing law, payment
  days) padded with boilerplate clauses; the question asks one field;
* `recall`: a warm-up for retrieval (associative recall, as MQAR): 2 to 12 unrelated facts (as
  many as `length` holds), little filler, and every fact asked, one per turn, whatever `turns`
  says: many answer tokens per document token, so the copy mechanism is learned first;
* `copy`: a warm-up (the copy task): a random list of values, names and words, and the answer is
  the whole document again. Every answer token after the first is predictable only by finding
  the copied position in the document.
* `induction` and `lookup`: warm-ups made of token ids rather than text (`symbolic.py`):
  copying by content, and finding a value by its key across a chat turn.

The word lists are in `pools.py`. Filler is built from them and many sentence shapes, with
numbers in it, so a value is not the only digit run and the text is not periodic. Every choice
comes from a numpy generator seeded by (seed, split, index): sample i is the same everywhere.

Train / eval split: every pool a fact or a question is drawn from (entity names, value formats,
fact sentences, question phrasings, contract clauses and formats) is cut in two, disjointly, by
`split_pool`; eval samples use only the eval halves, so evaluation never sees a training needle.
Sentences and company and code names are composed from parts (`pools.Composed`): hundreds of
training phrasings, too many to learn by heart, and held-out ones that are new sentences of
familiar pieces. Filler words, attribute names and the words a contract names its fields by
(`CONTRACT_TERMS`) are shared: they are the language, not the facts. A contract question names
its field by the document's word half of the time, else by a synonym.

`encode_sample` renders a sample exactly as `salabatch run` feeds it: the tokenizer's
`document_prompt(document) + prompt_suffix(question)`, then the answer and the end-of-turn token
as the target. `TaskGenerator.encoded(index, length)` gives what training reads, every kind
included (the symbolic kinds have no text form).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from salabatch.engine.tokenizer import Tokenizer
from salabatch.errors import ConfigError
from salabatch.train.pools import (
    ADJECTIVES,
    AMOUNT_FORMATS,
    ATTRIBUTES,
    BOILERPLATE,
    CLAUSES,
    CODE_SYLLABLES,
    CODENAMES,
    COMPANY_KINDS,
    COMPANY_STEMS,
    CONTRACT_HEADS,
    CONTRACT_QUESTIONS,
    CONTRACT_TERMS,
    COPY_QUESTIONS,
    DATE_FORMATS,
    ENTITY_SHAPES,
    FACTS,
    FILLER,
    FIRST_NAMES,
    JURISDICTIONS,
    LAST_NAMES,
    NOUNS,
    QUESTIONS,
    VALUE_FORMATS,
    VERBS,
    Composed,
)
from salabatch.train.symbolic import induction, lookup
from salabatch.train.text import (
    END_OF_TURN,
    capital,
    distinct,
    filler_sentence,
    follow_up_turn,
    pick,
    place_facts,
)

TRAIN, EVAL = "train", "eval"
SPLITS = (TRAIN, EVAL)
KINDS = ("needle", "multi", "contract")  # the question-answering kinds, the default
WARMUPS = ("induction", "lookup", "recall", "copy")  # stages before them (never a default)
SYMBOLIC = {"induction": induction, "lookup": lookup}  # kinds that are token ids, not text
ALL_KINDS = KINDS + WARMUPS
TURN_TOKENS = 84  # tokens a question and its answer take, about (a document leaves them room)


def split_pool(items: Sequence | Composed, split: str, every: int = 4) -> tuple:
    """The `split` half of a pool: every `every`-th item (from the last of each group) is eval;
    of a `Composed` pool, its held-out combinations."""
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}", expected=" or ".join(SPLITS), got=split)
    if isinstance(items, Composed):
        return items.split(held=split == EVAL)
    held = [i % every == every - 1 for i in range(len(items))]
    return tuple(x for x, h in zip(items, held, strict=True) if h == (split == EVAL))


@dataclass(frozen=True)
class Sample:
    """One task: `document`, `question`, the `answer` (a span of the document), its `kind`,
    and `depth`: where the answering sentence sits in the document (0 = start, 1 = end).
    `more`: further questions about the same document, asked as later chat turns."""

    document: str
    question: str
    answer: str
    kind: str
    depth: float
    more: tuple[tuple[str, str], ...] = ()  # follow-up (question, answer) turns (training)


@dataclass(frozen=True)
class Encoded:
    """Token ids of prompt + targets; `targets` are the [start, stop) spans of `ids` the model
    must generate (each answer + its end of turn), the first at `answer_start`."""

    ids: list[int]
    targets: tuple[tuple[int, int], ...]

    @property
    def answer_start(self) -> int:
        return self.targets[0][0]


class TaskGenerator:
    """Samples of one split; `sample(index, length)` is a pure function of (seed, split, index,
    length, kinds, turns). `length` is the target of the whole prompt in tokens (±1 sentence).
    `turns` > 1 asks up to that many questions per document (the first as `salabatch run` asks
    it, the rest as follow-up turns): more answer tokens per document token when training."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        split: str = TRAIN,
        seed: int = 0,
        kinds: Sequence[str] = KINDS,
        system: str | None = None,
        turns: int = 1,
    ) -> None:
        unknown = sorted(set(kinds) - set(ALL_KINDS))
        if unknown or not kinds:
            raise ConfigError("unknown task kinds", expected=", ".join(ALL_KINDS), got=kinds)
        self.tok = tokenizer
        self.split = split
        self.seed = seed
        self.kinds = tuple(kinds)
        self.system = system
        if not 1 <= turns <= 6:
            raise ConfigError("turns must be 1 to 6", field="turns", got=turns)
        self.turns = turns
        self.pools = {
            name: split_pool(pool, split)
            for name, pool in {
                "codes": CODENAMES,
                "syllables": CODE_SYLLABLES,
                "first": FIRST_NAMES,
                "last": LAST_NAMES,
                "stems": COMPANY_STEMS,
                "law": JURISDICTIONS,
                "values": VALUE_FORMATS,
                "facts": FACTS,
                "questions": QUESTIONS,
                "copy": COPY_QUESTIONS,
                "amounts": AMOUNT_FORMATS,
                "dates": DATE_FORMATS,
                "clauses": CLAUSES,
                "heads": CONTRACT_HEADS,
                "contract_questions": CONTRACT_QUESTIONS,
            }.items()
        }
        # The chat wrapping's own tokens, so a document is sized to fill `length`.
        self.overhead = len(tokenizer.document_prompt("x", system=system, think=False))

    def encoded(self, index: int, length: int) -> Encoded:
        """Sample `index` as token ids and target spans, whatever its kind."""
        rng = self._rng(index)
        kind = self.kinds[rng.integers(len(self.kinds))]
        if kind in SYMBOLIC:
            return Encoded(*SYMBOLIC[kind](self.tok, rng, length))
        return self.encode(self.sample(index, length))

    def sample(self, index: int, length: int) -> Sample:
        rng = self._rng(index)
        kind = self.kinds[rng.integers(len(self.kinds))]
        if kind in SYMBOLIC:
            raise ConfigError(f"{kind} samples are token ids, not text: use encoded()")
        budget = max(length - self.overhead - TURN_TOKENS * self.turns, 16)
        if kind == "contract":
            return self._contract(rng, budget)
        if kind == "copy":  # the answer is as long as the document
            return self._copy(rng, (length - self.overhead - 32) // 2)
        if kind == "needle":
            return self._facts(rng, budget, n_facts=self.turns, related=False)
        if kind == "recall":  # a fact and its turn ≈ 100 tokens: as many as `length` holds
            most = max(2, min(12, length // 100))
            n = min(12, max(self.turns, most - int(rng.integers(2))))
            budget = max(length - self.overhead - 75 * n, 0)  # the fact's own tokens: _embed
            return self._facts(rng, budget, n_facts=n, related=False, ask_all=True)
        return self._facts(rng, budget, n_facts=int(rng.integers(max(3, self.turns), 7)))

    def needle_document(self, index: int, length: int, depths: Sequence[float]) -> list[Sample]:
        """One document of about `length` prompt tokens holding one unrelated key → value fact
        at each of `depths` (0 = start, 1 = end; up to 12); a Sample per fact, all with the same
        document, each asking its fact (what `bench needle` asks as one batch)."""
        if not 1 <= len(depths) <= len(ATTRIBUTES) or not all(0 <= d <= 1 for d in depths):
            raise ConfigError("need 1 to 12 depths in [0, 1]", field="depths", got=depths)
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), index, 1])
        p, n = self.pools, len(depths)
        ents = distinct(rng, lambda: self._entity(rng), n)
        attrs = [ATTRIBUTES[i] for i in rng.permutation(len(ATTRIBUTES))[:n]]
        values = distinct(rng, lambda: pick(rng, p["values"])(rng), n)
        facts = [
            capital(pick(rng, p["facts"]).format(attr=a, ent=e, val=v))
            for e, a, v in zip(ents, attrs, values, strict=True)
        ]
        budget = max(length - self.overhead - TURN_TOKENS, 16) - sum(self._count(f) for f in facts)
        filler = self._filler(rng, budget, FILLER)
        # each fact goes before the filler sentence at its depth's share of the filler tokens
        sizes = np.cumsum([0] + [self._count(f) for f in filler])
        slots = [int(np.searchsorted(sizes, d * sizes[-1])) for d in depths]
        sentences: list[str] = []
        for i in range(len(filler) + 1):
            sentences += [facts[j] for j in np.argsort(slots, kind="stable") if slots[j] == i]
            if i < len(filler):
                sentences.append(filler[i])
        paragraphs = [" ".join(sentences[i : i + 6]) for i in range(0, len(sentences), 6)]
        document = "\n\n".join(paragraphs)
        return [
            Sample(
                document,
                capital(pick(rng, p["questions"]).format(attr=a, ent=e)),
                v,
                "needle",
                float(d),
            )
            for e, a, v, d in zip(ents, attrs, values, depths, strict=True)
        ]

    def encode(self, sample: Sample, think: bool = False) -> Encoded:
        return encode_sample(self.tok, sample, system=self.system, think=think)

    def _rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, SPLITS.index(self.split), index])

    # -- kinds --------------------------------------------------------------------------------
    def _facts(
        self,
        rng: np.random.Generator,
        budget: int,
        n_facts: int,
        related: bool = True,
        ask_all: bool = False,
    ) -> Sample:
        """One asked fact plus `n_facts - 1` others: distractors sharing its entity or its
        attribute if `related`, else unrelated needles. Follow-up turns ask some of the others
        (all of them if `ask_all`: the recall kind)."""
        p = self.pools
        ents = distinct(rng, lambda: self._entity(rng), n_facts)
        attrs = [ATTRIBUTES[i] for i in rng.permutation(len(ATTRIBUTES))[:n_facts]]
        values = distinct(rng, lambda: pick(rng, p["values"])(rng), n_facts)
        # fact 0 is asked; related others share its entity (odd) or its attribute (even)
        pairs = [(ents[0], attrs[0])] + [
            (ents[0], attrs[i]) if i % 2 and related else (ents[i], attrs[i if not related else 0])
            for i in range(1, n_facts)
        ]
        facts = [
            pick(rng, p["facts"]).format(attr=a, ent=e, val=v)
            for (e, a), v in zip(pairs, values, strict=True)
        ]
        facts = [capital(f) for f in facts]
        questions = [capital(pick(rng, p["questions"]).format(attr=a, ent=e)) for e, a in pairs]
        document, depths = self._embed(rng, facts, budget, shuffle=True)
        kind = "recall" if ask_all else "needle" if not related else "multi"
        asked = self._follow_ups(rng, n_facts, n_facts - 1 if ask_all else self.turns - 1)
        more = [(questions[i], values[i]) for i in asked]
        return Sample(document, questions[0], values[0], kind, depths[0], tuple(more))

    def _copy(self, rng: np.random.Generator, budget: int) -> Sample:
        """Items (a value, a name or a filler word) until `budget` tokens; lines of 8 items."""
        p = self.pools
        draws = (
            lambda: pick(rng, p["values"])(rng),
            lambda: self._entity(rng),
            lambda: pick(rng, (*NOUNS, *ADJECTIVES, *VERBS)),
        )
        items: list[str] = []
        while budget > 0:
            items.append(draws[int(rng.integers(len(draws)))]())
            budget -= self._count(items[-1])
        lines = [" ".join(items[i : i + 8]) for i in range(0, len(items), 8)]
        document = "\n".join(lines)
        return Sample(document, pick(rng, p["copy"]), document, "copy", 0.0)

    def _follow_ups(self, rng: np.random.Generator, n: int, count: int | None = None) -> list[int]:
        """Which of items 1..n-1 the follow-up turns ask (`count`, default turns - 1), in a
        random order."""
        count = self.turns - 1 if count is None else count
        return [1 + int(i) for i in rng.permutation(n - 1)[:count]]

    def contract_document(self, index: int, length: int) -> tuple[str, dict[str, str]]:
        """A contract of about `length` prompt tokens and its fields (provider, client, amount,
        start, term, law, payment), each the exact answer to that field's questions (what the
        demo's documents and answer key are made of)."""
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), index, 2])
        budget = max(length - self.overhead - TURN_TOKENS, 16)
        document, fields, _, _ = self._contract_document(rng, budget)
        return document, fields

    def _contract(self, rng: np.random.Generator, budget: int) -> Sample:
        document, fields, terms, depths = self._contract_document(rng, budget)
        names = list(rng.permutation(list(fields)))
        asked = [names[0], *(names[i] for i in self._follow_ups(rng, len(names)))]
        questions = [self._contract_question(rng, name, terms[name]) for name in asked]
        more = tuple((q, fields[name]) for q, name in zip(questions[1:], asked[1:], strict=True))
        first = asked[0]
        depth = 0.0 if first in ("provider", "client") else depths[_CLAUSE_OF[first]]
        return Sample(document, questions[0], fields[first], "contract", depth, more)

    def _contract_question(self, rng: np.random.Generator, field: str, term: str) -> str:
        """A question about `field`, naming it by the document's `term` half of the time, else
        by any of the field's words (the model learns them as synonyms)."""
        if rng.random() < 0.5:
            term = pick(rng, CONTRACT_TERMS[field])
        return capital(pick(rng, self.pools["contract_questions"]).format(term=term))

    def _contract_document(
        self, rng: np.random.Generator, budget: int
    ) -> tuple[str, dict[str, str], dict[str, str], list[float]]:
        """A services agreement of about `budget` tokens: its text, its fields, the word it
        names each field by, and the depth of each clause (in `_CLAUSE_OF` order)."""
        p = self.pools
        provider, client = distinct(rng, lambda: self._company(rng), 2)
        fields = {
            "provider": provider,
            "client": client,
            "amount": pick(rng, p["amounts"]).format(n=f"{int(rng.integers(20, 5000)) * 250:,}"),
            "start": pick(rng, p["dates"])(
                int(rng.integers(2024, 2036)), int(rng.integers(12)), int(rng.integers(1, 29))
            ),
            "term": f"{int(rng.choice([6, 12, 18, 24, 36, 48, 60]))} months",
            "law": pick(rng, p["law"]),
            "payment": f"{int(rng.choice([10, 14, 15, 21, 30, 45, 60, 90]))} days",
        }
        terms = {name: pick(rng, words) for name, words in CONTRACT_TERMS.items()}
        parties = pick(rng, p["heads"]).format(
            provider=provider, client=client, pterm=terms["provider"], cterm=terms["client"]
        )
        head = f"SERVICES AGREEMENT. {parties}"
        clauses = [
            capital(pick(rng, p["clauses"]).format(term=terms[name], val=fields[name]))
            for name in _CLAUSE_OF
        ]
        body, depths = self._embed(
            rng, clauses, budget - self._count(head), shuffle=False, shapes=BOILERPLATE + FILLER
        )
        return f"{head}\n\n{body}", fields, terms, depths

    # -- pieces -------------------------------------------------------------------------------
    def _entity(self, rng: np.random.Generator) -> str:
        """A name of one of `ENTITY_SHAPES`: a project's code name is a word or a made-up one."""
        p = self.pools
        shape = pick(rng, ENTITY_SHAPES)
        code = pick(rng, p["codes"] if rng.random() < 0.5 else p["syllables"])
        return shape.format(code=code, first=pick(rng, p["first"]), last=pick(rng, p["last"]))

    def _company(self, rng: np.random.Generator) -> str:
        return f"{pick(rng, self.pools['stems'])} {pick(rng, COMPANY_KINDS)}"

    def _count(self, text: str) -> int:
        return len(self.tok.encode(" " + text, special=False))

    def _filler(self, rng: np.random.Generator, budget: int, shapes: Sequence[str]) -> list[str]:
        """Sentences of `shapes` until they total at least `budget` tokens."""
        filler: list[str] = []
        while budget > 0:
            filler.append(filler_sentence(rng, shapes))
            budget -= self._count(filler[-1])
        return filler

    def _embed(
        self,
        rng: np.random.Generator,
        facts: list[str],
        budget: int,
        *,
        shuffle: bool,
        shapes: Sequence[str] = FILLER,
    ) -> tuple[str, list[float]]:
        """Sentences of `shapes` totalling about `budget` tokens with `facts` placed at random
        depths (in a random order if `shuffle`, else in the order given), in paragraphs; the
        depth of each fact, in the order given."""
        budget -= sum(self._count(f) for f in facts)
        return place_facts(rng, facts, self._filler(rng, budget, shapes), shuffle=shuffle)


_CLAUSE_OF = {"start": 0, "term": 1, "amount": 2, "payment": 3, "law": 4}


def encode_sample(
    tokenizer: Tokenizer, sample: Sample, *, system: str | None = None, think: bool = False
) -> Encoded:
    """The prompt `salabatch run` builds for (document, question), then the answer's tokens and
    the end-of-turn token: what the model must generate. Follow-up questions (`sample.more`)
    continue as further user turns of the chat, each followed by its answer."""
    ids = tokenizer.document_prompt(sample.document, system=system, think=think)
    ids += tokenizer.prompt_suffix(sample.question, system=system, think=think)
    eot = tokenizer.token_id(END_OF_TURN)
    targets = []
    for i, (question, answer) in enumerate(((sample.question, sample.answer), *sample.more)):
        if i:
            ids += tokenizer.encode(follow_up_turn(question, think=think), special=True)
        start = len(ids)
        ids += tokenizer.encode(answer, special=False) + [eot]
        targets.append((start, len(ids)))
    return Encoded(ids, tuple(targets))
