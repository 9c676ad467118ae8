"""Demonstration (the seed's repetition case): a reward that counts occurrences of the answer in the
completion is hacked by repeating the answer, and the health alarms catch it; the same run with the
proper reward (exact match) raises no alarm at all.

Setup, sized for a 2-core CPU (about a minute in all):
- the demo's task (grpokit.tasks.arithmetic), restricted to problems without a units carry, on
  which the teacher is right: a tiny model learns them well enough in 300 supervised steps;
- a tiny Qwen2 (hidden 64, 2 layers) warm-started on the teacher's demonstrations, where the
  teacher writes its answer twice ("75 75") in 30% of them. Language models repeat themselves; a
  model that never saw text after its answer would not find the hole in a test-sized run. The
  proper reward scores a repeated answer 0, the hackable one 2;
- GRPO as in the demo preset (G = 8, temperature 1, no KL), 8 prompts a step, lr 2e-4, completions
  of up to 24 tokens, greedy exact-match pass@1 and sampled mean@4 on 100 held-out problems every
  5 steps (the alarm follows mean@k: sampled, like the training reward). In the
  hacked run exact match is listed first with weight 0: it is the pass criterion of the eval (a
  trusted checker kept apart from the training reward) and adds nothing to the reward.

Measured with these seeds: the hacked run's held-out pass@1 falls from 0.64 to 0 within 20 steps
while its reward rises; `reward_hacking` fires and stops the run at step 25-55, depending on the
float path (following greedy pass@1: 25 and 30 with oneDNN GEMMs, 50 with BLAS GEMMs and on the CI
machine; following mean@4: 40 with oneDNN, 55 with BLAS). The clean run learns (pass@1 0.33 -> ~0.6)
with no alarm. Against greedy pass@1 the clean run fired on one float path (grpokit's own training
forward): its sampled reward rose by 0.104 as the policy sharpened while greedy pass@1 wandered
between 0.57 and 0.76; mean@k, sampled like the reward, rises with it. The `reward_hacking` defaults were changed for this
(eval_window 5 -> 8, reward_smooth 10 -> 20): with the old ones, 4 of 7 clean runs of this setup
fired it on noise (a 0.1 reward 'rise' over 5 evals with greedy pass@1 dipping by ~0.1).
"""

import json
import random

import pytest
import torch

from grpokit import rewards
from grpokit.config import load_config
from grpokit.monitor.health import tally_alarms
from grpokit.tasks.arithmetic import ArithmeticTask
from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model, save_pretrained
from grpokit.train import build_trainer
from grpokit.train.sft import sft

pytestmark = pytest.mark.slow

STUTTER = 0.3          # share of demonstrations in which the teacher repeats its answer
EVAL_EVERY = 5
EVAL_SAMPLES = 4       # held-out mean@k, which the reward-hacking test follows (sampled, like the reward)
HACK_STEPS = 120       # budget for the hacked run; it is stopped by the alarm well before (steps 25-55 seen)

if "test_answer_count" not in rewards.REGISTRY:
    @rewards.register("test_answer_count")
    def answer_count(prompts, completions, *, answer, cap: int = 8, **columns):
        """The hackable reward: how many times the reference answer occurs in the completion
        (capped), so "75 75 75" scores 3 where "75" scores 1."""
        return [float(min(str(c).count(str(a)), cap)) for c, a in zip(completions, answer)]


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """The warm-started model and the prompt files."""
    root = tmp_path_factory.mktemp("hacking")
    task = ArithmeticTask(seed=0, heldout=100, carry_frac=0.0)
    torch.manual_seed(0)
    tok = build_char_tokenizer("0123456789+= ")
    model = build_tiny_model(tok, hidden=64, layers=2, heads=4, intermediate=192, max_positions=48, seed=0)
    teacher_rng = random.Random(99)

    def pairs(n, rng):
        out = []
        for a, b in task.draw(n, rng):
            answer = task.teacher(a, b, teacher_rng)
            if teacher_rng.random() < STUTTER:
                answer = f"{answer} {answer}"
            out.append((f"{a}+{b}=", answer))
        return out

    sft(model, tok, pairs, steps=300, lr=2e-3, seed=0)
    save_pretrained(model, tok, root / "warm")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in task.train_rows(5000, 7)))
    (root / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in task.heldout_rows()))
    return root


def _run(root, name: str, reward_specs: str, steps: int, *extra: str):
    cfg = load_config(["demo"], [
        f"model.path={root / 'warm'}", f"data.path={root / 'train.jsonl'}",
        f"data.eval_path={root / 'heldout.jsonl'}", f"train.run_dir={root / name}", f"train.steps={steps}",
        f"train.eval_every={EVAL_EVERY}", f"train.eval_samples={EVAL_SAMPLES}", "train.save_every=0", "train.sample_every=0", "train.progress=false",
        "rollout.max_new_tokens=24", "rollout.batch_size=64", "optim.lr=2e-4", "optim.micro_batch_size=64",
        f"rewards={reward_specs}", *extra])
    tr = build_trainer(cfg)
    tr.train()
    rows = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
    path = root / name / "alarms.jsonl"
    alarms = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    return tr, rows, alarms


def test_a_reward_that_counts_the_answer_is_hacked_and_an_alarm_fires(warm):
    tr, rows, alarms = _run(warm, "hacked", "[{name: exact_match, weight: 0.0}, {name: test_answer_count}]", HACK_STEPS,
                            "health.reward_hacking.action=stop", "health.length_explosion.action=stop")
    tally = tally_alarms(alarms)
    fired = {name: t.first.step for name, t in tally.items()}
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    sampled = [round(r["eval/mean@k"], 3) for r in rows if "eval/mean@k" in r]
    print(f"\nhacked run: alarms first fired {fired}; eval/pass@1 {evals}; mean@k {sampled}; "
          f"reward/mean {[round(r['reward/mean'], 2) for r in rows]}")
    assert {"reward_hacking", "length_explosion"} & set(fired)
    assert tr.health.should_stop and tr.step_idx < HACK_STEPS    # stopped at the first firing
    # it is the hack: held-out accuracy collapsed while the policy writes its answer again (the
    # warm-started model does so in ~25% of samples at temperature 1, never greedily)
    best = max(p for _, p in evals)
    assert evals[-1][1] <= 0.25 * best
    repeated = _share_repeating(tr)
    print(f"hacked run: {repeated:.0%} of the last batch write more than one number")
    assert repeated >= 0.45


def _share_repeating(tr) -> float:
    completions = tr.last_batch.completions
    return sum(len(c.split()) >= 2 for c in completions) / len(completions)


def test_the_same_run_with_the_proper_reward_raises_no_alarm(warm):
    tr, rows, alarms = _run(warm, "clean", "[{name: exact_match}]", 40)
    evals = [r["eval/pass@1"] for r in rows if "eval/pass@1" in r]
    print(f"\nclean run: eval/pass@1 {evals}; health: {tr.health.summary()}")
    assert alarms == []
    assert tr.health.summary().startswith("Healthy")
    assert tr.step_idx == 40
    assert sum(evals[-3:]) / 3 > evals[0]                         # and it learned,
    assert _share_repeating(tr) <= 0.15                          # not to repeat itself
