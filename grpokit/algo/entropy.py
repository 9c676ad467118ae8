"""Adaptive entropy control: an entropy bonus whose coefficient follows a target entropy.

Skywork-OR1 (He et al. 2025, arXiv 2505.22312, §3.2.3) keeps the policy's entropy from collapsing
with a coefficient c that moves by a fixed step towards holding a target entropy e*:

    c_{k+1} = clip(c_k + Δ · sign(e* − e_k), 0, c_max)        (up while e_k < e*, down otherwise)

and applies the bonus (loss − c · H) only while the entropy is at or below the target: the
coefficient used for update k+1 is c_{k+1} · 1{e_k ≤ e*}, e_k being the mean per-token entropy of
update k (the latest known when update k+1 starts). A run whose entropy never falls to the target
never pays for the bonus; one that collapses gets a bonus growing by Δ per step until it recovers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class EntropyControl:
    target: float                 # e*, nats per token
    step: float = 0.0005          # Δ
    max_coef: float = 0.01        # c_max
    coef: float = 0.0             # c_k
    last_entropy: float | None = None

    def __post_init__(self):
        if not (self.target > 0 and self.step > 0 and self.max_coef > 0):
            raise ValueError("entropy control: target, step and max_coef must be > 0")
        self.coef = min(max(float(self.coef), 0.0), self.max_coef)

    def update(self, entropy: float) -> float:
        """Record update k's entropy; return the coefficient for update k+1. A non-finite entropy
        (a skipped update) leaves the coefficient where it was."""
        if entropy is None or not math.isfinite(entropy):
            return self.active
        self.last_entropy = float(entropy)
        self.coef += self.step if entropy < self.target else -self.step
        self.coef = min(max(self.coef, 0.0), self.max_coef)
        return self.active

    @property
    def active(self) -> float:
        """The coefficient the next update uses: c, while the last entropy was at or below the target."""
        if self.last_entropy is not None and self.last_entropy > self.target:
            return 0.0
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, s: dict) -> None:
        self.coef, self.last_entropy = float(s["coef"]), s.get("last_entropy")
