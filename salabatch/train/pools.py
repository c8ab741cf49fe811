"""The word pools of the synthetic tasks (`data.py`): entity names, value formats, fact and
question sentences, contract fields and formats, filler and boilerplate. `data.split_pool` cuts
the pools marked so into a training and an evaluation half."""

from __future__ import annotations

import numpy as np

# -- pools (split by `_split`) ----------------------------------------------------------------

CODENAMES = (
    "Aurora", "Basalt", "Cinder", "Dynamo", "Ember", "Falcon", "Glacier", "Harbor", "Indigo",
    "Juniper", "Kestrel", "Lantern", "Meridian", "Nimbus", "Obsidian", "Pioneer", "Quartz",
    "Rampart", "Sapphire", "Tundra", "Umber", "Vanguard", "Willow", "Xenon", "Yarrow", "Zephyr",
    "Atlas", "Beacon", "Cobalt", "Delta", "Echo", "Fjord", "Granite", "Helios", "Iris", "Jasper",
    "Kodiak", "Lumen", "Monsoon", "Nova", "Orchid", "Polaris", "Quill", "Raven", "Sierra",
    "Talon", "Ultra", "Vertex", "Wren", "Yukon",
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
COMPANY_STEMS = (
    "Northwind", "Bluefield", "Ironbridge", "Silverline", "Redcliff", "Greystone", "Oakhaven",
    "Brightwater", "Stonegate", "Clearpath", "Highmoor", "Westbrook", "Eastmere", "Goldcrest",
    "Riverton", "Ashford", "Larkspur", "Pinecrest", "Seabright", "Thornbury",
)  # fmt: skip
COMPANY_KINDS = (
    "Logistics", "Analytics", "Holdings", "Systems", "Foods", "Robotics", "Energy", "Textiles",
    "Labs", "Partners", "Freight", "Media",
)  # fmt: skip
JURISDICTIONS = (
    "Delaware", "New York", "Ontario", "Bavaria", "Victoria", "Texas", "Scotland", "Quebec",
    "California", "Geneva", "Oregon", "Lisbon",
)  # fmt: skip
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)  # fmt: skip
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
FACTS = (
    "The {attr} for {ent} is {val}.",
    "For {ent}, the {attr} was set to {val}.",
    "Please note that the {attr} of {ent} is {val}.",
    "{ent} uses {val} as its {attr}.",
    "Record: {attr} of {ent} = {val}.",
    "It was confirmed that {ent} has the {attr} {val}.",
    "Remember this: the {attr} assigned to {ent} is {val}.",
    "According to the memo, {ent} received {val} as the {attr}.",
)
QUESTIONS = (
    "What is the {attr} for {ent}?",
    "Which {attr} belongs to {ent}?",
    "Tell me the {attr} of {ent}.",
    "What {attr} was given to {ent}? Answer with the value only.",
    "Find the {attr} assigned to {ent}.",
    "According to the document, what is {ent}'s {attr}?",
    "Give the {attr} for {ent}, nothing else.",
    "I need the {attr} of {ent}. What is it?",
)
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

# Contract fields: the question phrasings per field (split like QUESTIONS).
CONTRACT_QUESTIONS = {
    "provider": (
        "Who is the service provider in this agreement?",
        "Which company provides the services?",
        "Name the provider under this contract.",
        "What company acts as the Provider?",
    ),
    "client": (
        "Who is the client in this agreement?",
        "Which company receives the services?",
        "Name the client party of the contract.",
        "What company is the Client?",
    ),
    "amount": (
        "What is the total contract amount?",
        "How much is the client required to pay in total?",
        "State the total fee of the agreement.",
        "What is the contract value?",
    ),
    "start": (
        "What is the effective date of the agreement?",
        "When does the contract take effect?",
        "On what date does this agreement start?",
        "Give the commencement date of the contract.",
    ),
    "term": (
        "How long is the initial term?",
        "What is the duration of the agreement?",
        "For how many months does the contract run?",
        "State the length of the initial term.",
    ),
    "law": (
        "Which jurisdiction's law governs the agreement?",
        "What is the governing law of the contract?",
        "Under whose laws is the agreement construed?",
        "Name the governing jurisdiction.",
    ),
    "payment": (
        "Within how many days must invoices be paid?",
        "What are the payment terms in days?",
        "How many days does the client have to pay an invoice?",
        "State the invoice payment period.",
    ),
}
# Contract formats, by split: train then eval.
AMOUNT_FORMATS = (
    lambda n: f"${n:,}",
    lambda n: f"${n:,}.00",
    lambda n: f"USD {n:,}",
    lambda n: f"{n:,} US dollars",
)
DATE_FORMATS = (
    lambda y, m, d: f"{MONTHS[m]} {d}, {y}",
    lambda y, m, d: f"{y}-{m + 1:02d}-{d:02d}",
    lambda y, m, d: f"{d:02d}/{m + 1:02d}/{y}",
    lambda y, m, d: f"{d} {MONTHS[m]} {y}",
)

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
