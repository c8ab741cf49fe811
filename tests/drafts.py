"""A Generator that records what it is given, for the tests of what carries speculative
decoding's settings to the engine and its counts back (job runs, the API, the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, field

from salabatch.engine.generate import Generation, Generator, Request
from salabatch.engine.speculative import Speculation


@dataclass
class Recorded:
    speculations: list[Speculation] = field(default_factory=list)  # one per Generator made
    requests: list[Request] = field(default_factory=list)  # every request decoded

    def request(self, request_id: str) -> Request:
        (found,) = [r for r in self.requests if r.id == request_id]
        return found


def drafted(g: Generation) -> tuple[int, int]:
    """The draft counts `record_generators` gives a finished row: (2n + 1, n) for n tokens, so
    that each row's counts differ and none is the engine's default 0."""
    return 2 * len(g.tokens) + 1, len(g.tokens)


def record_generators(monkeypatch, *modules) -> Recorded:
    """Replaces `Generator` in each of `modules` by one that records its Speculation and the
    requests it decodes, and gives each finished row the counts of `drafted` (which the engine,
    whatever its drafters do, would not)."""
    seen = Recorded()

    class Recording(Generator):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            seen.speculations.append(self.speculation)

        def stream(self, requests, prefix=None):
            requests = list(requests)
            seen.requests.extend(requests)
            for g in super().stream(requests, prefix):
                if g.done:
                    g.draft_tokens, g.accepted_tokens = drafted(g)
                yield g

    for module in modules:
        monkeypatch.setattr(module, "Generator", Recording)
    return seen
