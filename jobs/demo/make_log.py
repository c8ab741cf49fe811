"""Writes `docs/lighthouse-log.txt`: a synthetic keeper's log long enough (several thousand tokens)
that the demo model's sparse layers switch to InfLLM-v2. Deterministic: same text every run.

    python jobs/demo/make_log.py
"""

from __future__ import annotations

import random
from pathlib import Path

WEATHER = [
    "clear and calm", "light rain from the south-west", "fog until mid-morning", "a fresh north "
    "wind with high cloud", "squalls and heavy rain", "overcast, sea moderate", "bright, a long "
    "swell from the west", "gale force gusts after dark", "drizzle, visibility under a mile",
    "cold and still, frost on the gallery rail",
]
TASKS = [
    "cleaned and polished the lens prisms", "trimmed and checked the reserve lamp", "greased the "
    "rotation gear and checked its timing", "painted the lantern room door", "replaced a cracked "
    "pane in the storm glazing", "tested the fog signal for ten minutes", "pumped out the cistern "
    "and checked the filter", "scraped rust from the gallery handrail", "logged the barometer "
    "hourly through the night", "repaired the hinge on the oil store door", "re-tarred the "
    "boathouse roof", "cleared the drain under the stair landing",
]
VISITORS = [
    "the relief keeper, Joram Petersen", "the district engineer, Helga Marsh", "the supply boat "
    "skipper, Nils Ouderkerk", "two students from the marine survey", "the harbour master, "
    "Bartholomew Reyes", "the coastguard inspector, Fenna Dijkstra", "a fisherman sheltering "
    "from the weather", "the postman, Willem Tan",
]
SHIPS = ["the coaster Meridian", "a Danish trawler", "the ferry Saint Brendan", "two yachts",
         "the survey vessel Kittiwake", "a tug towing a barge", "no vessels"]
SUPPLIES = ["lamp oil", "paraffin", "tinned food", "fresh water", "coal", "paint", "lens cloths"]


def entry(day: int, rng: random.Random) -> str:
    lines = [f"Day {day}. Weather: {rng.choice(WEATHER)}. Barometer {rng.randint(985, 1032)} hPa."]
    lines.append(f"Light lit at {rng.randint(16, 18)}:{rng.choice(['05', '20', '35', '50'])} and "
                 f"put out at {rng.randint(6, 8)}:{rng.choice(['00', '15', '30', '45'])}.")
    for task in rng.sample(TASKS, 2):
        lines.append(f"In the day I {task}.")
    if rng.random() < 0.4:
        lines.append(f"Visitor: {rng.choice(VISITORS)}.")
    lines.append(f"Traffic seen from the gallery: {rng.choice(SHIPS)}.")
    if rng.random() < 0.3:
        amount = rng.randint(2, 40)
        lines.append(f"Received {amount} units of {rng.choice(SUPPLIES)} with the supply boat.")
    if day % 9 == 0:
        lines.append("Wrote the fortnightly report to the district office and sent it ashore.")
    return " ".join(lines)


if __name__ == "__main__":
    rng = random.Random(7)
    head = ("Log of the Skerry Point lighthouse, kept by Agnes Vollmer, principal keeper.\n"
            "One entry per day; times are local.\n\n")
    body = "\n\n".join(entry(day, rng) for day in range(1, 26))
    (Path(__file__).parent / "docs" / "lighthouse-log.txt").write_text(head + body + "\n", encoding="utf-8")
