"""The held-out checker: what scores `eval/pass@1`, chosen to be independent of the training reward.

The reward-hacking signal is "the training reward rises while held-out pass@1 stays flat or falls"
(docs/metrics.md). Scored by the training reward itself, a hole in that reward raises both
together and the signal never fires. So held-out completions are scored by a checker that shares
no code with the training rewards where grpokit has one (`eval.checker: auto`):

1. a reward listed first with weight 0: a trusted checker the run logs but does not train on;
2. `code_tests` when it is a training reward: the held-out prompts' own unit tests (for code the
   tests are the ground truth; a format or length term on top is what gets hacked);
3. math answers (references that the independent parser reads as math): `math_accuracy_alt`,
   grpokit's second implementation (its own extraction and sympy comparison), or `math_accuracy`
   (math-verify) when the alt is itself trained on; neither inherits a training reward's loosened
   settings (`strict_numbers: false`), only its answer column;
4. else the first training reward, and the run says at start that the signal is not independent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .compose import RewardSet, RewardSpec, _explicit_params, check_args
from .user import resolve

MATH = ("math_accuracy_alt", "math_accuracy")
PROBE_ROWS = 64
"""References read to decide whether a dataset's answers are math."""


@dataclass
class Checker:
    name: str
    args: dict = field(default_factory=dict)
    independent: bool = True
    why: str = ""
    """How it was chosen, for the start-of-run line."""

    def reward_set(self, fns=None) -> RewardSet:
        """Its RewardSet; `fns`: name -> function for rewards no longer registered (a `grpokit.GRPO`
        callable, registered only while the run is built)."""
        if fns is not None and self.name in fns:
            fn = fns[self.name]
            return RewardSet([RewardSpec(name=self.name, args=check_args(self.name, fn, self.args))], [fn])
        return RewardSet.from_specs([{"name": self.name, "args": self.args}])

    def describe(self) -> str:
        if self.independent:
            return f"held-out pass@1 is scored by {self.name} ({self.why})"
        return (f"held-out pass@1 is scored by the training reward {self.name} ({self.why}): a hole in it raises "
                "reward and pass@1 together, so the reward-hacking alarm cannot see it; set eval.checker to a "
                "verifier that shares no code with the training rewards (docs/rewards.md, \"The held-out checker\")")


def _spec(s) -> dict:
    return s.model_dump() if hasattr(s, "model_dump") else dict(s)


def _answer_args(specs: list[dict], checker: str) -> dict:
    """The answer column of a math training reward, the only setting a math checker takes from one."""
    accepted = _explicit_params(resolve(checker))
    for s in specs:
        col = s.get("args", {}).get("answer_column")
        if col is not None and "answer_column" in accepted:
            return {"answer_column": col}
    return {}


def _math_rows(rows: list[dict], column: str) -> list[dict]:
    """Up to PROBE_ROWS rows whose reference the independent parser reads as math (a number or an
    expression; not a word, not a lone letter such as a multiple-choice "A"), or [] when fewer than
    90% of the references looked at do."""
    from ._mathalt import _to_sympy, reference_alt

    refs = [r for r in rows[:PROBE_ROWS * 4] if r.get(column) not in (None, "")][:PROBE_ROWS]
    good = []
    for r in refs:
        ref = reference_alt(str(r[column]))
        try:
            if ref and not ref.strip().isalpha() and _to_sympy(ref) is not None:
                good.append(r)
        except Exception:  # noqa: BLE001 - not math to this parser
            pass
    return good if refs and len(good) >= 0.9 * len(refs) else []


RENDERINGS = ("{a}", "\\boxed{{{a}}}", "The answer is {a}.")
"""Ways a right answer may be written (bare, boxed, in a sentence), to see which ones the training
reward accepts and whether the checker reads the same answers."""


def _agrees(checker: "Checker", trained: dict, rows: list[dict], column: str, threshold: float, fns) -> bool:
    """The checker reads the answers the training reward pays for: for at least 90% of the rows
    whose reference, written in some of RENDERINGS, the training reward `trained` scores >=
    threshold, the checker also passes one of those writings. (A bare `\\frac{1}{2}` is read
    differently by the two math checkers, its boxed form alike, so one shared writing suffices.)
    A probe that fails counts as no agreement."""
    import logging

    prompts = [r["prompt"] if isinstance(r["prompt"], str) else str(r["prompt"]) for r in rows]
    cols = {k: [r.get(k) for r in rows] for k in {k for r in rows for k in r if k != "prompt"}}
    try:
        fn = fns[trained["name"]] if fns and trained["name"] in fns else resolve(trained["name"])
        train_set = RewardSet([RewardSpec(name=trained["name"], args=check_args(trained["name"], fn,
                                                                                trained.get("args", {})))], [fn])
        check_set = checker.reward_set(fns)
        paid = [False] * len(rows)
        read = [False] * len(rows)
        for form in RENDERINGS:
            comps = [form.format(a=str(r[column])) for r in rows]
            t = train_set.score(prompts, comps, cols).per_fn[trained["name"]]
            c = check_set.score(prompts, comps, cols).per_fn[checker.name]
            for i, (tv, cv) in enumerate(zip(t, c)):
                if tv is not None and tv >= threshold:
                    paid[i] = True
                    read[i] = read[i] or (cv is not None and cv >= threshold)
        n = sum(paid)
        return n > 0 and sum(read) >= 0.9 * n
    except Exception as exc:  # noqa: BLE001 - a probe that fails picks no checker
        logging.getLogger("grpokit.rewards").info("eval.checker probe of %s failed: %s", checker.name, exc)
        return False


def choose_checker(setting: str, args: dict, reward_specs, rows: list[dict], *, threshold: float = 1.0,
                   fns=None) -> Checker:
    """The checker for `eval.checker` = `setting` (with `eval.checker_args` = `args`), given the
    run's reward specs and some held-out rows (to tell math answers, and to check that a math
    checker accepts the right answers written the way the training reward wants them);
    `threshold`: the pass threshold; `fns`: name -> function of rewards no longer registered."""
    specs = [_spec(s) for s in reward_specs]
    trained = [s for s in specs if s.get("weight", 1.0) != 0]
    names = {s["name"] for s in trained}
    if setting != "auto":
        same = next((s for s in specs if s["name"] == setting), None)
        use = dict(args) if args else dict(same.get("args", {})) if same else _answer_args(specs, setting)
        if setting in names:
            return Checker(setting, use, False, "eval.checker names a training reward")
        return Checker(setting, use, True, "eval.checker")
    first = specs[0]
    if first.get("weight", 1.0) == 0:
        return Checker(first["name"], dict(args or first.get("args", {})), True,
                       "listed first with weight 0: logged, not trained on")
    if "code_tests" in names:
        code = next(s for s in trained if s["name"] == "code_tests")
        return Checker("code_tests", dict(args or code.get("args", {})), True, "the held-out prompts' unit tests")
    free = [m for m in MATH if m not in names]
    if free:
        use = dict(args) if args else _answer_args(specs, free[0])
        column = use.get("answer_column", "answer")
        probe = _math_rows(rows, column)
        ch = Checker(free[0], use, True, "math answers, checked by an implementation the training rewards do not use")
        if probe and _agrees(ch, trained[0], probe, column, threshold, fns):
            return ch
    return Checker(first["name"], dict(args or first.get("args", {})), False, "eval.checker: auto found no "
                   "independent verifier for this task")
