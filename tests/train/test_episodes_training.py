"""Multi-turn episodes in training: observation tokens out of the loss and the KL, one advantage
per episode, the same episodes on `hf` and `hf_copy`, resume mid-run, evaluation, config checks."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch

from grpokit import cli
from grpokit.config import load_config
from grpokit.errors import ConfigError
from grpokit.rollout.episodes import EnvSpec
from grpokit.tasks.tiny import build_chat_tokenizer, build_tiny_model, save_pretrained
from grpokit.train import build_run
from tests.fixtures import small_overrides
from tests.rollout.agent_envs import CalcEnv
from tests.rollout.test_episodes import CHARS, ScriptedEngine, call, said
from tests.rollout.test_episodes import CalcEnv as EpisodeCalc


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return episode_inputs(tmp_path_factory.mktemp("episodes"))


def episode_inputs(root):
    """(root, model_dir, train.jsonl, tokenizer): a tiny random chat model and four "What is A*B?" rows."""
    tok = build_chat_tokenizer(CHARS)
    model_dir = save_pretrained(build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64,
                                                 max_positions=1024), tok, root / "model")
    rows = [{"prompt": f"What is {a}*{b}?", "answer": a * b} for a, b in [(12, 3), (7, 8), (21, 4), (5, 9)]]
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, model_dir, data, tok


def overrides(setup, name, **extra):
    root, model_dir, data, _ = setup
    return small_overrides(model_dir, data, root / name, **{
        "rollout.group_size": 2, "rollout.batch_size": 4, "rollout.max_new_tokens": 60, "optim.micro_batch_size": 4,
        "rewards": "[{name: test_text_length}]", "train.steps": 1, "algorithm.kl.beta": 0.1,
        "algorithm.kl.controller": "fixed", **extra})


def scripted_trainer(setup, name, **extra):
    _, _, _, tok = setup
    turns = {0: [said(tok, call("12*3")), said(tok, "36")], 1: [said(tok, "I think 36"), said(tok, "x")]}
    engine = ScriptedEngine(tok, lambda t, k: turns[k][t])
    torch.manual_seed(0)
    extra = {"rollout.max_new_tokens": 300, **extra}
    return build_run(load_config(None, overrides(setup, name, **extra)), engine=engine, env=EnvSpec(CalcEnv),
                     health=False, report=False)


def test_observation_tokens_never_reach_the_loss_or_the_kl(setup):
    a, b = scripted_trainer(setup, "mask_a"), scripted_trainer(setup, "mask_b")
    a.step()
    batch = a.last_batch
    obs = (batch.mask == 1) & (batch.action_mask == 0)
    assert obs.any() and not (batch.loss_mask.bool() & obs).any()
    assert torch.equal(batch.lengths, batch.action_mask.sum(-1))
    assert batch.episodes[0]["tool_calls"] == 1 and batch.episodes[1]["tool_calls"] == 0
    # the same update with anything at all in the observation positions: the same loss, KL and weights
    wild = batch
    for f in ("old_logp", "ref_logp", "sampler_logp"):
        t = getattr(wild, f)
        if t is not None:
            setattr(wild, f, torch.where(obs, t + 3.0, t))
    before = {n: p.detach().clone() for n, p in b.worker.model.named_parameters()}
    mb = b.worker.train_step(wild, 0.1)
    ref = scripted_trainer(setup, "mask_c")
    clean = a.last_batch
    for f in ("old_logp", "ref_logp", "sampler_logp"):
        t = getattr(clean, f)
        if t is not None:
            setattr(clean, f, torch.where(obs, t - 3.0, t))
    mc = ref.worker.train_step(clean, 0.1)
    for k in ("loss/policy", "loss/kl", "kl/ref"):
        assert mb[k] == pytest.approx(mc[k], rel=1e-6, abs=1e-9), k
    for (n, p), (_, q) in zip(b.worker.model.named_parameters(), ref.worker.model.named_parameters()):
        assert torch.allclose(p, q, atol=1e-7), n
    assert any(not torch.equal(before[n], p) for n, p in b.worker.model.named_parameters())


def test_one_advantage_per_episode_from_the_group_s_episode_rewards(setup):
    tr = scripted_trainer(setup, "adv", **{"rewards": "[{name: env}, {name: test_text_length}]"})
    tr.step()
    batch = tr.last_batch
    r, adv = batch.rewards.double(), batch.advantages.double()
    for rows in batch.group_rows():
        g = r[rows]
        want = (g - g.mean()) / g.std() if g.std() > 0 else torch.zeros_like(g)
        assert torch.allclose(adv[rows], want, atol=1e-6)


def test_a_rewriting_template_trains_one_segment_per_turn_with_the_episode_s_advantage(setup, tmp_path):
    from tests.rollout.test_episodes import rewriting_tokenizer

    root, _, data, _ = setup
    tok = rewriting_tokenizer()
    model_dir = save_pretrained(build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64,
                                                 max_positions=1024), tok, tmp_path / "model")
    turns = {0: [said(tok, "<think>12 threes</think>" + call("12*3")), said(tok, "36")], 1: [said(tok, "I think 36")]}
    engine = ScriptedEngine(tok, lambda t, k: turns[k][t])
    torch.manual_seed(0)
    cfg = load_config(None, small_overrides(model_dir, data, tmp_path / "run", **{
        "rollout.group_size": 2, "rollout.batch_size": 4, "rollout.max_new_tokens": 300, "optim.micro_batch_size": 4,
        "rewards": "[{name: test_text_length}]", "train.steps": 1, "algorithm.kl.beta": 0.1,
        "algorithm.kl.controller": "fixed"}))
    tr = build_run(cfg, engine=engine, env=EnvSpec(CalcEnv), health=False, report=False)
    before = {n: p.detach().clone() for n, p in tr.worker.model.named_parameters()}
    m = tr.step()
    b = tr.last_batch
    # 2 prompts x (an episode of two turns + one of one turn): six rows, each one turn as sampled
    assert len(b) == 6 and b.episode_of.tolist() == [0, 0, 1, 2, 2, 3]
    got = [b.completion_ids[i, :int(b.mask[i].sum())].tolist() for i in range(len(b))]
    assert got == [turns[0][0], turns[0][1], turns[1][0]] * 2
    assert torch.equal(b.loss_mask, b.mask) and torch.equal(b.action_mask, b.mask)
    # the second turn's prompt is the template's rendering, which dropped the first turn's reasoning
    assert "12 threes" not in tok.decode(b.prompt_ids[1]) and '"12*3"' in tok.decode(b.prompt_ids[1])
    # one advantage per episode, from the group's episode rewards (not counted once per segment)
    r = [float(b.rewards[i]) for i in (1, 2, 4, 5)]
    assert r[0] != r[1]
    for lo in (0, 3):
        a_ep, b_ep = float(b.advantages[lo]), float(b.advantages[lo + 2])
        assert float(b.advantages[lo + 1]) == a_ep
        assert a_ep == pytest.approx(-b_ep, abs=1e-6) and abs(a_ep) == pytest.approx(2 ** -0.5, rel=1e-5)
    assert m["completion/length_mean"] == pytest.approx(sum(len(t) for t in turns[0] + turns[1]) / 2)
    assert any(not torch.equal(before[n], p) for n, p in tr.worker.model.named_parameters())


def test_episodes_are_the_same_on_hf_and_hf_copy_and_train(setup):
    runs = {}
    for engine in ("hf", "hf_copy"):
        torch.manual_seed(0)
        cfg = load_config(None, overrides(setup, f"same_{engine}", **{
            "rollout.engine": engine, "rollout.env": "tests.rollout.agent_envs:AgainEnv",
            "rollout.agent.max_turns": 3, "rollout.max_new_tokens": 120, "train.steps": 2}))
        tr = build_run(cfg, health=False, report=False)
        m = tr.step()
        runs[engine] = (tr.last_batch.completion_ids.clone(), tr.last_batch.action_mask.clone(), m)
    (ia, ma, m), (ib, mb, _) = runs["hf"], runs["hf_copy"]
    assert torch.equal(ia, ib) and torch.equal(ma, mb)
    assert m["agent/turns_mean"] > 1 and 0 < m["agent/obs_token_frac"] < 1
    assert m["agent/stop_max_turns"] + m["agent/stop_length"] + m["agent/stop_stop"] == pytest.approx(1.0)


def test_a_resumed_run_continues_the_same_episodes(setup, tmp_path):
    def cfg(name, steps):
        return load_config(None, overrides(setup, name, **{
            "rollout.env": "tests.rollout.agent_envs:AgainEnv", "rollout.agent.max_turns": 2,
            "rollout.max_new_tokens": 80, "train.steps": steps, "train.save_every": 1}))
    torch.manual_seed(0)
    straight = build_run(cfg("straight", 2), health=False, report=False)
    straight.train()
    torch.manual_seed(0)
    build_run(cfg("resumed", 1), health=False, report=False).train()
    torch.manual_seed(0)
    again = build_run(cfg("resumed", 2), health=False, report=False)
    again.train(resume=True)
    assert torch.equal(straight.last_batch.completion_ids, again.last_batch.completion_ids)
    assert straight.last_batch.rewards.tolist() == again.last_batch.rewards.tolist()


def test_evaluation_runs_the_episodes_too(setup, tmp_path, capsys):
    root, model_dir, data, _ = setup
    (tmp_path / "episode_reward.py").write_text(
        "def played(prompts, completions, turns=None, stop_reason=None, **columns):\n"
        "    # 1 for a completion that came from an episode (its columns carry turns and a stop reason)\n"
        "    if turns is None:\n"
        "        return [0.0] * len(completions)\n"
        "    return [float(t >= 1 and r is not None) for t, r in zip(turns, stop_reason)]\n")
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("rollout:\n  env: tests.rollout.agent_envs:AgainEnv\n  max_new_tokens: 40\n"
                   f"rewards:\n  - {{name: '{tmp_path / 'episode_reward.py'}:played'}}\n"
                   f"eval: {{checker: '{tmp_path / 'episode_reward.py'}:played'}}\n")   # not the math checker
    assert cli.main(["eval", "--model", str(model_dir), "--data", str(data), "--config", str(cfg)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompts"] == 4 and out["eval/pass@1"] == 1.0       # every prompt was played as an episode


@pytest.mark.parametrize("extra, match", [
    ({"rollout.env": "tests.rollout.agent_envs:CalcEnv", "rollout.tools": "[tests.rollout.agent_envs:CalcEnv]"}, "not both"),
    ({"rollout.env": "tests.rollout.agent_envs:CalcEnv", "algorithm.rewrite.enabled": True}, "single-turn"),
])
def test_combinations_episodes_do_not_support_are_refused(setup, extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides(setup, "bad", **extra))


def test_sample_dumps_and_the_report_show_whole_episodes_with_observations_marked(setup):
    from grpokit.monitor.report import write_report
    tr = scripted_trainer(setup, "dump", **{"train.sample_every": 1})
    tr.train()
    rows = [json.loads(line) for line in (tr.run.path / "samples" / "step_000001.jsonl").read_text().splitlines()]
    first = rows[0]
    assert first["stop_reason"] == "stop" and first["turns"] == 2 and first["tool_calls"] == 1
    spans = first["spans"]
    assert [s["trained"] for s in spans] == [True, False, True]
    assert spans[0]["text"].startswith("<tool_call>") and "36" in spans[1]["text"] and spans[2]["text"] == "36<|im_end|>"
    assert "".join(s["text"] for s in spans) == first["completion"]
    html = write_report(tr.run.path).read_text()
    assert "<span class=obs>" in html and "never trained on" in html and "stopped: stop" in html


def test_the_kl_charged_to_the_reward_counts_only_the_policy_s_tokens(setup):
    tr = scripted_trainer(setup, "kl_reward", **{"algorithm.kl.in_reward": True})
    m = tr.step()
    b = tr.last_batch
    act = b.action_mask.bool()
    k1 = (b.old_logp.double() - b.ref_logp.double()).clamp(-20, 20)
    assert (b.mask.bool() & ~act).any()
    assert m["kl/ref"] == pytest.approx(float(k1[act].sum()) / int(act.sum()), rel=1e-6, abs=1e-9)
    assert torch.equal(b.lengths, act.sum(-1))


class FaultyCalc(EpisodeCalc):
    """The calculator, with a reset that fails on one row."""

    def reset(self, **row):
        if row["prompt"] == "What is 5*9?":
            raise RuntimeError("no sandbox for this row")
        return super().reset(**row)


def test_a_hung_tool_a_raising_tool_and_a_failed_reset_in_a_batch_of_16_episodes_do_not_end_the_step(setup):
    """4 prompts x G = 4: in each group one episode's tool hangs past the timeout and one's raises;
    one row's environment cannot start. The step trains on all 16 episodes, each with its reason."""
    _, _, _, tok = setup
    scripts, first_turns = [call("slow"), call("boom"), call("12*3"), "I think 36"], itertools.count()
    engine = ScriptedEngine(tok, lambda t, k: said(tok, scripts[next(first_turns) % 4]) if t == 0 else said(tok, "36"))
    cfg = load_config(None, overrides(setup, "faults", **{     # fewer workers than hung tools: the healthy
        "rollout.max_new_tokens": 300, "rollout.group_size": 4, "rollout.batch_size": 16,   # calls still run
        "optim.micro_batch_size": 16, "rollout.agent.tool_timeout_s": 0.5, "rollout.agent.tool_workers": 2}))
    torch.manual_seed(0)
    tr = build_run(cfg, engine=engine, env=EnvSpec(FaultyCalc), health=False, report=False)
    t0 = time.monotonic()
    m = tr.step()
    assert time.monotonic() - t0 < 9                   # waiting for the hung tools: >= 10 s (3 x 5 s, 2 workers)
    eps = tr.last_batch.episodes
    assert len(eps) == 16
    started = [e for e in eps if e["stop_reason"] != "env_error"]
    assert len(started) == 12 and [e["stop_reason"] for e in eps].count("env_error") == 4
    assert sum(e["tool_timeouts"] for e in started) == 3 and all(e["stop_reason"] == "stop" for e in started)
    answers = [m["content"] for e in started for m in e["messages"] if m["role"] == "tool"]
    assert answers.count("36") == 3                                   # the healthy calls were answered
    assert sum(e["tool_errors"] for e in started) == 6                # 3 timeouts + 3 raised
    assert m["agent/stop_env_error"] == pytest.approx(0.25) and m["agent/tool_timeouts"] == 3
    empty = [i for i, e in enumerate(eps) if e["stop_reason"] == "env_error"]
    assert int(tr.last_batch.action_mask[empty].sum()) == 0 and torch.isfinite(torch.tensor(m["loss/policy"]))


def test_an_environment_that_cannot_start_on_any_row_is_one_line(setup):
    class Broken(EpisodeCalc):
        def reset(self, **row):
            raise KeyError("answer")

    _, _, _, tok = setup
    tr = build_run(load_config(None, overrides(setup, "broken")), engine=ScriptedEngine(tok, lambda t, k: said(tok, "x")),
                   env=EnvSpec(Broken), health=False, report=False)
    with pytest.raises(ConfigError, match=r"Broken: the environment's reset\(\) failed: KeyError.*every row"):
        tr.step()


def test_episode_timing_concurrency_and_tool_latencies_are_reported(setup):
    """agent/episode_{generate,env,wait}_s (mean seconds per episode), agent/turn_batch_mean (live
    episodes per engine call) and the tool-call latency percentiles."""
    _, _, _, tok = setup

    class SlowCalc(EpisodeCalc):
        def calculator(self, expression: str) -> str:
            """Evaluate an arithmetic expression.

            Args:
                expression: digits and + - *, e.g. 12*3
            """
            time.sleep(0.2)
            return str(eval(expression, {"__builtins__": {}}))    # noqa: S307 - the script's expression

    calls = itertools.count()
    engine = ScriptedEngine(tok, lambda t, k: said(tok, call("12*3") if t == 0 and next(calls) % 2 == 0 else "36"))
    cfg = load_config(None, overrides(setup, "timing", **{"rollout.max_new_tokens": 300, "rollout.agent.tool_workers": 4}))
    tr = build_run(cfg, engine=engine, env=EnvSpec(SlowCalc), health=False, report=False)
    m = tr.step()
    # 4 episodes: 2 call the tool (one 0.2 s turn of tools), 2 answer at once and wait for them
    assert m["agent/turn_batch_mean"] == pytest.approx((4 + 2) / 2)
    assert 0.2 <= m["agent/tool_latency_p50"] <= m["agent/tool_latency_max"] < 2
    assert m["agent/episode_env_s"] == pytest.approx(sum(e["time_env"] for e in tr.last_batch.episodes) / 4)
    called = [e for e in tr.last_batch.episodes if e["tool_calls"]]
    assert len(called) == 2 and all(e["time_env"] >= 0.2 for e in called)
    assert all(e["time_wait"] >= 0.15 for e in tr.last_batch.episodes if not e["tool_calls"])
