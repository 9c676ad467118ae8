"""The curriculum of Dr. GRPO as practised: a difficulty bar lifted by the running pass rate (never
lowered), and the most informative prompts (passed about half the time) first under it."""

import math

import pytest

from grpokit.config import load_config
from grpokit.data.curriculum import Curriculum
from grpokit.rewards import REGISTRY, register
from grpokit.train import build_trainer
from tests.fixtures import arithmetic_files, small_overrides, tiny_model_dir


def test_the_bar_follows_the_running_pass_rate_and_never_falls():
    cur = Curriculum(start=0.3, end=1.0, rise_from=0.5, rise_to=0.9, running_ema=0.5)
    assert cur.threshold(0) == 0.3 and cur.threshold(10_000) == 0.3      # steps alone do not lift it
    cur.observe_step(0.2)
    cur.observe_step(0.4)                                                 # rho = 0.3: below rise_from
    assert cur.running == pytest.approx(0.3) and cur.threshold(2) == 0.3
    cur.observe_step(0.9)                                                 # rho = 0.6: a quarter of the way
    assert cur.running == pytest.approx(0.6)
    assert cur.threshold(3) == pytest.approx(0.3 + 0.7 * (0.6 - 0.5) / 0.4)
    cur.observe_step(1.0)                                                 # rho = 0.8
    high = 0.3 + 0.7 * (0.8 - 0.5) / 0.4
    assert cur.threshold(4) == pytest.approx(high)
    cur.observe_step(0.0)                                                 # harder prompts: rho 0.4, the bar holds
    assert cur.running == pytest.approx(0.4) and cur.threshold(5) == pytest.approx(high)
    for _ in range(20):
        cur.observe_step(1.0)
    assert cur.threshold(30) == pytest.approx(1.0)                        # capped at end
    other = Curriculum(start=0.3)
    other.load_state_dict(cur.state_dict())                               # resumes where it was
    assert (other.running, other.level) == (cur.running, cur.level)


def test_informative_prompts_first_under_the_bar():
    cur = Curriculum(start=0.6, prior=0.5)
    rows = [{"difficulty": d} for d in (0.0, 0.55, 0.2, 0.9, 0.4)] + [{}]
    # admitted: d <= 0.6 -> 0 (p(1-p) = 0), 1 (0.2475), 2 (0.16), 4 (0.24), 5 (prior 0.5: 0.25)
    assert cur.choose(list(range(6)), rows, 6, step=0) == [5, 1, 4, 2, 0, 3]
    assert Curriculum(start=0.6, prior=0.5, bar="steps", ramp_steps=10**9).choose(
        list(range(6)), rows, 6, step=0) == [0, 2, 4, 5, 1, 3]           # the classic order: easiest first


def test_bad_settings_are_refused_and_the_old_ramp_asks_for_its_bar():
    with pytest.raises(Exception, match="bar: steps"):
        load_config(None, ["data.curriculum.ramp_steps=50"])
    from grpokit.config import Config

    Config.model_validate(Config().model_dump(mode="json"))          # a saved config.yaml (every field) loads
    load_config(None, ["data.curriculum.ramp_steps=50", "data.curriculum.bar=steps",
                       "data.curriculum.rise_from=0.9", "data.curriculum.rise_to=0.5"])   # rise_* unused by steps
    with pytest.raises(Exception, match="rise_from"):
        load_config(None, ["data.curriculum.rise_from=0.9", "data.curriculum.rise_to=0.5"])
    with pytest.raises(Exception, match="pass_rate"):
        load_config(None, ["data.curriculum.bar=loss"])


for _name, _value in (("test_always_passes", 1.0), ("test_never_passes", 0.0)):
    if _name not in REGISTRY:
        register(_name)(lambda prompts, completions, _v=_value, **columns: [_v] * len(completions))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("curriculum")
    return root, tiny_model_dir(root / "model"), arithmetic_files(root / "data")[0]


@pytest.mark.parametrize("reward,rises", [("test_always_passes", True), ("test_never_passes", False)])
def test_the_trainer_lifts_the_bar_with_the_pass_rate(setup, reward, rises):
    root, model_dir, train = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / reward, **{
        "rewards": f"[{{name: {reward}}}]", "train.steps": 3, "data.curriculum.enabled": True,
        "data.curriculum.start": 0.4, "data.curriculum.running_ema": 0.5}))
    tr = build_trainer(cfg, health=False)
    bars = [tr.step()["curriculum/bar"] for _ in range(3)]
    rho = [1.0] * 3 if rises else [0.0] * 3            # the running pass rate (it starts at the first step's)
    want = [0.4 + 0.6 * min(1.0, max(0.0, (r - 0.5) / 0.4)) for r in rho]
    assert bars == pytest.approx(want)
    assert (bars[-1] > 0.4) == rises and all(math.isfinite(b) for b in bars)


def test_the_curriculum_sees_every_sampled_group_not_only_the_kept_ones(setup):
    """With dynamic sampling, groups that all pass are dropped from the batch, but the curriculum
    still observes them (and their prompts' pass rates): both rounds' groups are recorded and the
    running pass rate is 1, not the kept groups' mix."""
    root, model_dir, train = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / "dyn", **{
        "rewards": "[{name: test_always_passes}]", "data.curriculum.enabled": True,
        "rollout.dynamic_sampling": True, "rollout.max_sampling_rounds": 2}))
    tr = build_trainer(cfg, health=False)
    m = tr.step()
    cur = tr.step_fn.collector.curriculum
    P = cfg.prompts_per_step
    assert m["dynamic/rounds"] == 2 and m["curriculum/pass_rate"] == 1.0
    assert len(cur.difficulty) == 2 * P and set(cur.difficulty.values()) == {0.0}
    assert tr.step_fn.collector.scored == []                      # released once read
