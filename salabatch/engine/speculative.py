"""Speculative decoding: draft a few tokens cheaply, verify them with one pass of the full model.

(Skeleton: settings only; the drafters and the verifier follow.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DRAFTS = ("off", "lookup", "layers", "auto")
Draft = Literal["off", "lookup", "layers", "auto"]


@dataclass(frozen=True)
class Speculation:
    """How a batch drafts: `off`; `lookup` (what followed the generated text's latest n-gram in
    the row's document and prompt); `layers` (the model's first `layers` layers and its head);
    `auto` (lookup where its measured acceptance pays, per row). `tokens`: drafts per step."""

    draft: Draft = "auto"
    tokens: int = 4
    layers: int = 8

    def __post_init__(self) -> None:
        if self.draft not in DRAFTS:
            raise ValueError(f"draft must be one of {', '.join(DRAFTS)}, got {self.draft!r}")
        if self.tokens < 1 or self.layers < 1:
            raise ValueError(f"draft tokens and layers must be ≥ 1: {self}")


OFF = Speculation("off")
