"""Curriculum sampling: easy prompts first, harder ones as training goes on (practitioner's rule
"Dr. GRPO as practised", docs/training.md).

Each prompt's difficulty is 1 - its pass rate, tracked as an exponential moving average of the
fraction of its G samples that passed, every time it is drawn. A prompt never seen yet has the
difficulty given by its dataset column (`prior_field`, in [0, 1]) or `prior`. At step t the
threshold rises linearly from `start` to `end` over `ramp_steps`. To draw n prompts, the sampler
takes a pool of `pool_factor * n` candidates from the base (shuffled, resumable) order, keeps
those at or below the threshold, easiest first, and fills any shortfall with the easiest of the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Curriculum:
    start: float = 0.3
    end: float = 1.0
    ramp_steps: int = 100
    pool_factor: int = 4
    ema: float = 0.5
    prior: float = 0.5
    prior_field: str = "difficulty"
    difficulty: dict[int, float] = field(default_factory=dict)

    def threshold(self, step: int) -> float:
        frac = min(1.0, step / max(1, self.ramp_steps))
        return self.start + (self.end - self.start) * frac

    def estimate(self, idx: int, row: dict) -> float:
        if idx in self.difficulty:
            return self.difficulty[idx]
        v = row.get(self.prior_field)
        return float(v) if isinstance(v, (int, float)) else self.prior

    def choose(self, candidates: list[int], rows: list[dict], n: int, step: int) -> list[int]:
        """Pick n of `candidates` (dataset indices; rows are their dataset rows)."""
        scored = sorted(zip(candidates, rows), key=lambda cr: self.estimate(cr[0], cr[1]))
        thr = self.threshold(step)
        easy = [c for c, r in scored if self.estimate(c, r) <= thr]
        rest = [c for c, r in scored if self.estimate(c, r) > thr]
        return (easy + rest)[:n]

    def observe(self, idx: int, pass_rate: float) -> None:
        old = self.difficulty.get(idx)
        d = 1.0 - pass_rate
        self.difficulty[idx] = d if old is None else (1 - self.ema) * old + self.ema * d

    def state_dict(self) -> dict:
        return {"difficulty": dict(self.difficulty)}

    def load_state_dict(self, s: dict) -> None:
        self.difficulty = {int(k): float(v) for k, v in s["difficulty"].items()}
