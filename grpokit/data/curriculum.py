"""Curriculum sampling (practitioner's rule "Dr. GRPO as practised", docs/training.md): a bar on
prompt difficulty that rises as the policy gets better, medium prompts first under it.

Each prompt's difficulty is 1 - its pass rate, tracked as an exponential moving average (`ema`) of
the fraction of its G samples that passed, every time it is drawn. A prompt never seen yet has the
difficulty given by its dataset column (`prior_field`, in [0, 1]) or `prior`.

The bar (the most difficult prompt admitted), by `bar`:
- `pass_rate` (default): the running pass rate rho (an EMA with weight `running_ema` of each
  step's fraction of passing completions) lifts it,
      bar = max(bar so far, start + (end - start) * clip((rho - rise_from) / (rise_to - rise_from), 0, 1)),
  so the bar holds while the policy fails most of what it is served and rises as it masters it;
  it never falls (harder prompts lower rho, which must not hand them back the easy ones).
  Under the bar, the most informative prompts come first: those whose estimated pass rate p is
  closest to 1/2 (largest p(1 - p), the variance of a group's pass/fail rewards), so the policy
  trains on prompts it solves sometimes, not on those it always solves (no signal).
- `steps`: the bar rises linearly from `start` to `end` over `ramp_steps`, easiest first (the
  classic curriculum).

To draw n prompts, the sampler takes a pool of `pool_factor * n` candidates from the base
(shuffled, resumable) order, keeps those at or below the bar in the mode's order, and fills any
shortfall with the easiest of the rest.
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
    bar: str = "pass_rate"             # "pass_rate" | "steps"
    rise_from: float = 0.5
    rise_to: float = 0.9
    running_ema: float = 0.2
    difficulty: dict[int, float] = field(default_factory=dict)
    running: float | None = None       # the running pass rate (pass_rate bar)
    level: float | None = None         # the bar so far (pass_rate bar)

    def __post_init__(self):
        if self.bar not in ("pass_rate", "steps"):
            raise ValueError(f"curriculum bar must be pass_rate or steps, got {self.bar!r}")
        if self.bar == "pass_rate" and not self.rise_from < self.rise_to:
            raise ValueError(f"curriculum rise_from {self.rise_from:g} must be below rise_to {self.rise_to:g}")
        if self.level is None:
            self.level = self.start

    def threshold(self, step: int) -> float:
        """The bar at `step`: the most difficult prompt admitted."""
        if self.bar == "pass_rate":
            return self.level
        frac = min(1.0, step / max(1, self.ramp_steps))
        return self.start + (self.end - self.start) * frac

    def estimate(self, idx: int, row: dict) -> float:
        if idx in self.difficulty:
            return self.difficulty[idx]
        v = row.get(self.prior_field)
        return float(v) if isinstance(v, (int, float)) else self.prior

    def choose(self, candidates: list[int], rows: list[dict], n: int, step: int) -> list[int]:
        """Pick n of `candidates` (dataset indices; rows are their dataset rows)."""
        est = {c: self.estimate(c, r) for c, r in zip(candidates, rows)}
        thr = self.threshold(step)
        easy = [c for c in candidates if est[c] <= thr]
        rest = sorted((c for c in candidates if est[c] > thr), key=lambda c: est[c])
        if self.bar == "pass_rate":     # informative first: pass rate nearest 1/2 (stable: ties keep the order)
            easy.sort(key=lambda c: -(1 - est[c]) * est[c])
        else:
            easy.sort(key=lambda c: est[c])
        return (easy + rest)[:n]

    def observe(self, idx: int, pass_rate: float) -> None:
        old = self.difficulty.get(idx)
        d = 1.0 - pass_rate
        self.difficulty[idx] = d if old is None else (1 - self.ema) * old + self.ema * d

    def observe_step(self, pass_rate: float) -> None:
        """A step's fraction of passing completions: moves the running pass rate and, with the
        pass_rate bar, lifts the bar."""
        self.running = pass_rate if self.running is None else (1 - self.running_ema) * self.running + self.running_ema * pass_rate
        if self.bar == "pass_rate":
            frac = min(1.0, max(0.0, (self.running - self.rise_from) / (self.rise_to - self.rise_from)))
            self.level = max(self.level, self.start + (self.end - self.start) * frac)

    def metrics(self, step: int) -> dict[str, float]:
        return {"curriculum/bar": self.threshold(step),
                "curriculum/pass_rate": float("nan") if self.running is None else self.running}

    def state_dict(self) -> dict:
        return {"difficulty": dict(self.difficulty), "running": self.running, "level": self.level}

    def load_state_dict(self, s: dict) -> None:
        self.difficulty = {int(k): float(v) for k, v in s["difficulty"].items()}
        self.running = s.get("running")
        self.level = s.get("level", self.start) if s.get("level") is not None else self.start
