"""The word pools of the synthetic tasks (`data.py`): entity names, value formats, fact and
question sentences, contract fields and formats, filler and boilerplate. `data.split_pool` cuts
the pools marked so into a training and an evaluation half.

Sentences and names that a model could learn by heart from a few dozen strings are `Composed`
from parts instead: a question is a frame ("Tell me the {x}.") around a target ("{attr} of
{ent}") and a closer (" Be brief."), a company a front and a back ("Ash" + "ford"). Each part's
items appear in both splits; each whole string in one only (`Composed.split`), so a held-out
question is a new sentence made of familiar pieces, never one seen in training."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from itertools import product

import numpy as np

HELD_OUT = 4  # one item (or combination) in this many is kept for evaluation


@dataclass(frozen=True)
class Composed:
    """Every concatenation of one item of each part, in order; a `{x}` in an item (a frame)
    takes the next part's item in its place. A combination is held out for evaluation when the
    sum of its items' indices is 3 mod `HELD_OUT`."""

    parts: tuple[tuple[str, ...], ...]

    def split(self, held: bool) -> tuple[str, ...]:
        """The held-out combinations if `held`, else the training ones."""
        ranges = [range(len(part)) for part in self.parts]
        return tuple(
            self._join(idx)
            for idx in product(*ranges)
            if (sum(idx) % HELD_OUT == HELD_OUT - 1) == held
        )

    def _join(self, idx: Sequence[int]) -> str:
        text, frame = "", None
        for part, i in zip(self.parts, idx, strict=True):
            item = part[i]
            if frame is not None:
                text, frame = text + frame.replace("{x}", item), None
            elif "{x}" in item:
                frame = item
            else:
                text += item
        return text


# -- pools (split by `data.split_pool`) ------------------------------------------------------

CODENAMES = (
    "Aurora", "Basalt", "Cinder", "Dynamo", "Ember", "Falcon", "Glacier", "Harbor", "Indigo",
    "Juniper", "Kestrel", "Lantern", "Meridian", "Nimbus", "Obsidian", "Pioneer", "Quartz",
    "Rampart", "Sapphire", "Tundra", "Umber", "Vanguard", "Willow", "Xenon", "Yarrow", "Zephyr",
    "Atlas", "Beacon", "Cobalt", "Delta", "Echo", "Fjord", "Granite", "Helios", "Iris", "Jasper",
    "Kodiak", "Lumen", "Monsoon", "Nova", "Orchid", "Polaris", "Quill", "Raven", "Sierra",
    "Talon", "Ultra", "Vertex", "Wren", "Yukon",
)  # fmt: skip
CODE_SYLLABLES = Composed(  # made-up code names: "Vel" + "oran"
    (
        ("Ka", "Bel", "Dor", "Mar", "Tel", "Vor", "Sil", "Quin", "Ra", "Zen", "Lo", "Fen", "Gar",
         "Hal", "Jor", "Nim", "Or", "Pel", "Ser", "Tam", "Ul", "Vel", "Wyn", "Brax"),
        ("ra", "ion", "eth", "ar", "is", "on", "ax", "ia", "or", "un", "el", "yx", "oran", "ide",
         "ent", "aro"),
    )
)  # fmt: skip
FIRST_NAMES = (
    "Mira", "Jonas", "Elena", "Tobias", "Priya", "Marcus", "Ingrid", "Rafael", "Sofia", "Dmitri",
    "Amara", "Henrik", "Lucia", "Kenji", "Nadia", "Oscar", "Freya", "Mateo", "Yara", "Anton",
    "Clara", "Idris", "Leona", "Felix", "Zara", "Bruno", "Helga", "Omar", "Tessa", "Viktor",
    "Alma", "Emil",
)  # fmt: skip
LAST_NAMES = (
    "Castell", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Brennan", "Kowalski", "Haddad",
    "Varga", "Osei", "Petrov", "Delgado", "Nakamura", "Falk", "Quint", "Rossi", "Sundberg",
    "Achebe", "Holm", "Ivanova", "Marsh", "Novak", "Paredes", "Strand", "Whitlock", "Yilmaz",
    "Berg", "Calloway",
)  # fmt: skip
COMPANY_STEMS = Composed(  # "Ash" + "ford"
    (
        ("North", "Blue", "Iron", "Silver", "Red", "Grey", "Oak", "Bright", "Stone", "Clear",
         "High", "West", "East", "Gold", "River", "Ash", "Lark", "Pine", "Sea", "Thorn", "Elm",
         "Fair", "Maple", "Wolf", "Copper", "Swan", "Frost", "Fern"),
        ("wind", "field", "bridge", "line", "cliff", "stone", "haven", "water", "gate", "path",
         "moor", "brook", "mere", "crest", "ton", "ford", "spur", "wood", "bury", "dale", "well",
         "vale"),
    )
)  # fmt: skip
COMPANY_KINDS = (
    "Logistics", "Analytics", "Holdings", "Systems", "Foods", "Robotics", "Energy", "Textiles",
    "Labs", "Partners", "Freight", "Media",
)  # fmt: skip
JURISDICTIONS = (  # the held-out ones (every 4th) are spelt with tokens the others use
    "Delaware", "New York", "Ontario", "Bavaria", "Quebec", "Texas", "Scotland", "Victoria",
    "Lisbon", "Geneva", "Oregon", "California", "Nevada", "Alberta", "Saxony", "Tasmania",
    "Zurich", "Manitoba", "Florida", "Ireland", "Norway", "Vermont", "Hesse", "Queensland",
    "Maine", "Ohio", "Denmark", "Wales", "Brittany", "Finland", "Utah", "Catalonia",
)  # fmt: skip
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)  # fmt: skip
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"


def _digits(rng: np.random.Generator, n: int) -> str:
    return str(rng.integers(1, 10)) + "".join(str(d) for d in rng.integers(0, 10, n - 1))


def _letters(rng: np.random.Generator, n: int) -> str:
    return "".join(LETTERS[i] for i in rng.integers(0, len(LETTERS), n))


# Value formats of facts: 6 digits, 4-4 digits, AB-1234 ... (every 4th is eval: 5 digits, ...).
VALUE_FORMATS = (
    lambda r: _digits(r, 6),
    lambda r: f"{_digits(r, 4)}-{_digits(r, 4)}",
    lambda r: f"{_letters(r, 2)}-{_digits(r, 4)}",
    lambda r: _digits(r, 5),
    lambda r: _digits(r, 8),
    lambda r: f"{_letters(r, 1)}{_digits(r, 5)}",
    lambda r: f"{_digits(r, 3)}.{_digits(r, 3)}",
    lambda r: f"{_digits(r, 3)}-{_digits(r, 3)}-{_digits(r, 3)}",
)
ATTRIBUTES = (
    "secret verification code", "access PIN", "vault combination", "launch code",
    "badge number", "reference number", "override key", "serial number", "account number",
    "gate code", "license key", "tracking number",
)  # fmt: skip
FACTS = Composed(  # lead + core: "Please note that " + "the {attr} of {ent} is {val}."
    (
        ("", "Please note that ", "Remember this: ", "According to the memo, ",
         "It was confirmed that ", "For the record, ", "Note that ", "As agreed, "),
        ("the {attr} for {ent} is {val}.", "the {attr} of {ent} is {val}.",
         "{ent} uses {val} as its {attr}.", "the {attr} assigned to {ent} is {val}.",
         "{ent} has the {attr} {val}.", "{ent} received {val} as the {attr}.",
         "the {attr} given to {ent} was {val}.", "{val} is the {attr} of {ent}."),
    )
)  # fmt: skip
QUESTION_FRAMES = (
    "What is the {x}?", "Tell me the {x}.", "Give the {x}.", "Find the {x}.", "State the {x}.",
    "Report the {x}.", "Look up the {x}.", "I need the {x}.", "Please provide the {x}.",
    "Name the {x}.", "Which is the {x}?", "Quote the {x}.", "Write down the {x}.",
    "Identify the {x}.", "What was the {x}?", "Recall the {x}.",
)  # fmt: skip
CLOSERS = (
    "", " Answer with the value only.", " Reply with just the value.", " Nothing else, please.",
    " Be brief.", " Use the document.",
)  # fmt: skip
QUESTIONS = Composed(  # "Tell me the " + "{attr} of {ent}" + "." + " Be brief."
    (
        QUESTION_FRAMES,
        ("{attr} for {ent}", "{attr} of {ent}", "{attr} assigned to {ent}",
         "{attr} given to {ent}", "{attr} belonging to {ent}", "{attr} recorded for {ent}"),
        CLOSERS,
    )
)  # fmt: skip
COPY_QUESTIONS = (
    "Repeat the document exactly.",
    "Copy the text above word for word.",
    "Write the document out again, unchanged.",
    "Reproduce the list above exactly as written.",
)
ENTITY_SHAPES = (
    "Project {code}",
    "the {code} facility",
    "{first} {last}",
    "Operation {code}",
)

ENTITY_SHAPES = (
    "Project {code}",
    "the {code} facility",
    "{first} {last}",
    "Operation {code}",
    "the {code} account",
    "Unit {code}",
)

# Contract fields: the words a document and a question may name each field by (shared by both
# splits, like ATTRIBUTES: they are the language); clauses and questions are composed around one.
CONTRACT_TERMS = {
    "provider": ("Provider", "service provider", "supplier"),
    "client": ("Client", "customer", "buyer"),
    "amount": ("total fee", "contract value", "total amount"),
    "start": ("effective date", "commencement date", "start date"),
    "term": ("initial term", "duration", "contract term"),
    "law": ("governing law", "applicable law", "governing jurisdiction"),
    "payment": ("payment period", "payment term", "invoice due period"),
}
CONTRACT_QUESTIONS = Composed(  # "What is the " + "{term} of this agreement" + "?" + closer
    (
        QUESTION_FRAMES,
        ("{term}", "{term} of this agreement", "{term} in the contract",
         "{term} under the agreement", "{term} stated in the document",
         "{term} the parties agreed"),
        CLOSERS,
    )
)  # fmt: skip
CLAUSES = Composed(  # lead + core: "It is agreed that " + "the {term} shall be {val}."
    (
        ("", "The parties agree that ", "It is agreed that ", "Under this agreement, ",
         "For the avoidance of doubt, ", "As set out in the schedule, ", "In this agreement, ",
         "Subject to the clauses below, "),
        ("the {term} is {val}.", "the {term} shall be {val}.", "the {term} will be {val}.",
         "the {term} is set at {val}.", "the {term} is fixed as {val}."),
    )
)  # fmt: skip
CONTRACT_HEADS = (  # the parties' sentence: a role before its name, or after it
    "This agreement is made between {provider} (the {pterm}) and {client} (the {cterm}).",
    "The {pterm} is {provider} and the {cterm} is {client}.",
    "{provider}, the {pterm}, and {client}, the {cterm}, enter into this agreement.",
    "The parties are the {pterm}, {provider}, and the {cterm}, {client}.",
    "This contract binds {provider} (the {pterm}) and {client} (the {cterm}).",
    "Between the {pterm}, {provider}, and the {cterm}, {client}, this agreement is made.",
)
# Contract formats, by split: train then eval.
AMOUNT_FORMATS = Composed(  # "USD {x}" around "{n}.00": the number's currency, then its style
    (
        ("${x}", "US$ {x}", "USD {x}", "{x} US dollars", "{x} USD", "{x} dollars"),
        ("{n}", "{n}.00"),
    )
)  # held out: "USD {n}.00" and "{n} US dollars"; training has each piece in other combinations
DATE_FORMATS = (
    lambda y, m, d: f"{MONTHS[m]} {d}, {y}",
    lambda y, m, d: f"{y}-{m + 1:02d}-{d:02d}",
    lambda y, m, d: f"{d:02d}/{m + 1:02d}/{y}",
    lambda y, m, d: f"{d} {MONTHS[m]} {y}",
    lambda y, m, d: f"{d} {MONTHS[m][:3]} {y}",
    lambda y, m, d: f"{MONTHS[m]} {d} {y}",
    lambda y, m, d: f"{d:02d}.{m + 1:02d}.{y}",
    lambda y, m, d: f"{d} {MONTHS[m]}, {y}",
    lambda y, m, d: f"{WEEKDAYS[date(y, m + 1, d).weekday()]}, {MONTHS[m]} {d}, {y}",
)  # the last one gives " March" (a space, then the month) as a training answer's token too

# -- filler (shared by both splits) -----------------------------------------------------------

NOUNS = (
    "committee", "river", "engine", "garden", "report", "market", "bridge", "library", "storm",
    "harvest", "village", "factory", "orchestra", "satellite", "museum", "forest", "ferry",
    "workshop", "council", "laboratory", "highway", "festival", "archive", "harbor", "tower",
    "schedule", "budget", "survey", "kitchen", "network",
)  # fmt: skip
ADJECTIVES = (
    "quiet", "crowded", "ancient", "modern", "narrow", "bright", "muddy", "careful", "distant",
    "local", "remarkable", "ordinary", "fragile", "busy", "gentle", "noisy", "famous", "empty",
)  # fmt: skip
VERBS = (
    "inspected", "repaired", "visited", "described", "ignored", "praised", "moved", "painted",
    "measured", "delayed", "expanded", "cleaned", "photographed", "studied", "rebuilt",
)  # fmt: skip
TIMES = (
    "on Monday", "last spring", "after the rain", "before dawn", "in the late afternoon",
    "during the winter", "every other week", "at the end of the season", "that evening",
)  # fmt: skip
PLACES = (
    "the old quarter", "the northern valley", "the coast", "the central square",
    "the eastern district", "the hills", "the station", "the lakeside", "the port",
)  # fmt: skip
FILLER = (
    "The {adj} {noun} was {verb} {time}.",
    "Near {place}, the {adj} {noun} drew {n} visitors {time}.",
    "Nobody expected the {noun} to be {verb} so quickly.",
    "{Time}, the residents of {place} {verb} the {noun}.",
    "The {adj} {noun} stood beside the {noun2} for {n} years.",
    "Reports say the {noun} near {place} is {adj} but {adj2}.",
    "In {year}, the {noun} was {verb} by the {adj} crew.",
    "The {noun2} and the {noun} were both {verb} {time}.",
    "Some say the {noun} is the most {adj} place in {place_bare}.",
    "It took {n} days to finish the {adj} {noun}.",
    "Why the {noun} was {verb} remains unclear.",
    "Travelers often mention the {adj} {noun} of {place_bare}.",
    "After {n} attempts, the {noun} was finally {verb}.",
    "The {noun} closes at {hour} o'clock {time}.",
    "Every {noun} in {place_bare} looks {adj} {time}.",
    "She {verb} the {noun2} while the {noun} stayed {adj}.",
    "There were {n} {noun}s and one {adj} {noun2}.",
    "The guide {verb} the {adj} {noun} twice.",
)
BOILERPLATE = (
    "Each party shall keep the other party's confidential information secret.",
    "Neither party may assign this agreement without prior written consent.",
    "Notices shall be given in writing to the addresses stated above.",
    "This agreement constitutes the entire understanding between the parties.",
    "Any amendment must be signed by authorized representatives of both parties.",
    "The Provider shall perform the services with reasonable skill and care.",
    "Failure to enforce any provision shall not be deemed a waiver.",
    "If any clause is held invalid, the remaining clauses stay in force.",
    "The Client shall provide timely access to information the services require.",
    "Neither party is liable for delays caused by events beyond its control.",
    "Headings are for convenience only and do not affect interpretation.",
    "Either party may terminate for material breach not cured within {n} days.",
)
