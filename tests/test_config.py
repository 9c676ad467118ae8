import subprocess
import sys

import pytest

from grpokit.config import ConfigError, load_config


def test_defaults_follow_the_seed_table():
    cfg = load_config()
    assert cfg.rollout.group_size == 16
    assert cfg.rollout.temperature == 0.8
    assert cfg.algorithm.eps_low == cfg.algorithm.eps_high == 0.2
    assert cfg.algorithm.kl.beta == 0.02 and cfg.algorithm.kl.controller == "adaptive"
    assert cfg.optim.lr == 3e-6
    assert cfg.rollout.max_new_tokens == 2048


@pytest.mark.parametrize("override, fragment", [
    (["algorithm.eps_hgh=0.3"], "unknown config key 'algorithm.eps_hgh' (did you mean 'algorithm.eps_high'?)"),
    (["rollout.groupsize=8"], "did you mean 'rollout.group_size'"),
    (["rollout.temperature=hot"], "config key 'rollout.temperature'"),
    (["rollout.group_size=1", "rollout.batch_size=4"], "group_size must be >= 2"),
    (["rollout.group_size=3", "rollout.batch_size=16"], "must be divisible by rollout.group_size"),
    (["rollout.max_new_tokens=0"], "max_new_tokens must be > 0"),
    (["nonsense"], "must look like key.sub=value"),
])
def test_bad_config_is_one_line_naming_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    msg = str(err.value)
    assert fragment in msg
    assert "\n" not in msg


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  group_size: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(str(bad))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("algorithm:\n  advantag: grpo\n")
    with pytest.raises(ConfigError, match="did you mean 'algorithm.advantage'"):
        load_config(str(unknown))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "missing.yaml"))


def test_presets_extend_their_base():
    cfg = load_config("demo")
    assert cfg.rollout.group_size == 8                      # demo's own value
    assert cfg.algorithm.loss_agg == "seq_mean_token_mean"  # inherited from grpo.yaml
    assert cfg.rewards[0].name == "exact_match"


def test_cli_exits_2_with_one_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout:\n  group_sise: 8\n")
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(cfg)], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["error: unknown config key 'rollout.group_sise' (did you mean 'rollout.group_size'?)"]
    assert "Traceback" not in proc.stderr


def test_cli_missing_model_dir(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", "grpo", f"model.path={tmp_path / 'nope'}",
                           f"data.path={data}"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "model directory not found" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("paths, overrides", [
    (["dapo_wide_clip"], []),
    (["dapo"], ["algorithm.eps_high=2.0"]),
], ids=["preset", "override"])
def test_the_wide_upper_clip_loads_over_dapo(paths, overrides):
    """Clip-higher as the practitioner's rules set it (upper clip range 2.0, lower kept at 0.2),
    as a preset and as the documented one-line override; the rest is DAPO's."""
    from grpokit.algo.loss import clipped_surrogate

    cfg = load_config(paths, overrides)
    a = cfg.algorithm
    assert (a.eps_low, a.eps_high) == (0.2, 2.0)
    assert a.loss_agg == "token_mean" and a.mask_truncated and cfg.rollout.dynamic_sampling
    assert a.kl.beta == 0.02 and a.kl.controller == "adaptive"        # KL holds the wider ratio back
    assert load_config("dapo").algorithm.eps_high == 0.28              # dapo itself keeps the paper's value
    assert load_config("dapo_paper").algorithm.eps_high == 0.28
    # a ratio of 2.5 on a good response: clipped at 1.28 by dapo, kept whole under the wide clip;
    # a bad response's ratio of 0.5 is clipped at 0.8 in both
    import torch
    ratio, adv = torch.tensor([2.5, 0.5]), torch.tensor([1.0, -1.0])
    wide = clipped_surrogate(ratio, adv, a.eps_low, a.eps_high, None)
    paper = clipped_surrogate(ratio, adv, 0.2, 0.28, None)
    assert wide.tolist() == pytest.approx([-2.5, 0.8]) and paper.tolist() == pytest.approx([-1.28, 0.8])


def test_the_code_preset_and_its_stacking_with_dapo():
    cfg = load_config("code")
    assert (cfg.rollout.group_size, cfg.rollout.batch_size) == (32, 256) and cfg.prompts_per_step == 8
    assert [(r.name, r.weight) for r in cfg.rewards] == [("code_tests", 1.0)]
    assert cfg.algorithm.loss_agg == "seq_mean_token_mean"             # the rest is grpo's
    both = load_config(["code", "dapo_wide_clip"])                      # later files win
    assert (both.rollout.group_size, both.rewards[0].name) == (32, "code_tests")
    assert both.algorithm.eps_high == 2.0 and both.rollout.dynamic_sampling and both.algorithm.kl.beta == 0.02


# ----------------------------------------------------------------------- registered names


@pytest.mark.parametrize("override, fragment", [
    ("algorithm.advantage=grpoo", "unknown advantage estimator 'grpoo'; did you mean 'grpo'?"),
    ("algorithm.loss_agg=token_men", "unknown loss aggregation 'token_men'; did you mean 'token_mean'?"),
    ("algorithm.kl.estimator=k3is", "unknown KL estimator 'k3is'; did you mean 'k3_is'?"),
    ("algorithm.kl.controller=adaptve", "unknown KL controller 'adaptve'; did you mean 'adaptive'?"),
    ("rollout.engine=hff", "unknown rollout engine 'hff'; did you mean 'hf'?"),
    ("rewards=[{name: exact_mach}]", "unknown reward 'exact_mach'; did you mean 'exact_match'?"),
    ("crosscheck={primary: math_accuracy, checker: math_acuracy_alt}", "did you mean 'math_accuracy_alt'?"),
])
def test_misspelled_registered_name_is_one_line_with_the_closest_and_the_valid_names(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    msg = str(err.value)
    assert fragment in msg and "\n" not in msg
    assert "(known: " in msg or "(registered: " in msg        # the valid names are listed
    assert msg.startswith("config key '")                      # and the key is named


def test_a_user_registered_advantage_estimator_is_usable_from_yaml(tmp_path):
    import torch

    from grpokit.algo import ESTIMATORS, compute_advantages, register_estimator
    from grpokit.config import config_from_dict

    with pytest.raises(ConfigError, match="unknown advantage estimator 'centered'"):
        config_from_dict({"algorithm": {"advantage": "centered"}})  # not registered yet

    def centered(rewards, cells, *, eps, lengths=None):
        return rewards - rewards.mean()

    register_estimator("centered", centered)
    try:
        cfg_file = tmp_path / "run.yaml"
        cfg_file.write_text("base: grpo\nalgorithm:\n  advantage: centered\n")
        cfg = load_config(str(cfg_file))
        assert cfg.algorithm.advantage == "centered"
        assert config_from_dict({"algorithm": {"advantage": "centered"}}).algorithm.advantage == "centered"
        adv = compute_advantages(cfg.algorithm.advantage, torch.tensor([1.0, 3.0]), 2)
        assert adv.tolist() == [-1.0, 1.0]
    finally:
        del ESTIMATORS["centered"]


def test_user_registered_engine_and_controller_are_accepted():
    from grpokit.algo import CONTROLLERS, register_controller
    from grpokit.algo.control import FixedKL
    from grpokit.rollout import ENGINES, get_engine, register_engine

    register_engine("mine", lambda model, tokenizer, **kw: ("engine", model, tokenizer))
    register_controller("mine", FixedKL)
    try:
        cfg = load_config(None, ["rollout.engine=mine", "algorithm.kl.controller=mine"])
        assert cfg.rollout.engine == "mine" and cfg.algorithm.kl.controller == "mine"
        assert get_engine("mine")("m", "t") == ("engine", "m", "t")
        with pytest.raises(ValueError, match="did you mean 'mine'"):
            get_engine("mien")
    finally:
        del ENGINES["mine"], CONTROLLERS["mine"]


def test_engine_registry_imports_nothing_heavy():
    code = ("import sys, grpokit.rollout as r; assert 'hf' in r.ENGINES and callable(r.get_engine('hf')); "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("override, fragment", [
    ("algorithm.sample_filter.format_reward=boxed_fromat",
     "format_reward 'boxed_fromat' is not one of the rewards (exact_match, boxed_format); did you mean 'boxed_format'?"),
    ("crosscheck={primary: exact_mach}", "crosscheck.primary 'exact_mach' is not one of the rewards"),
])
def test_reward_references_must_name_one_of_the_rewards(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rewards=[{name: exact_match}, {name: boxed_format}]", override])
    assert fragment in str(err.value)


@pytest.mark.parametrize("section", ["rewards=[{name: exact_match, timeout_s: %s}]",
                                     "crosscheck={primary: math_accuracy, timeout_s: %s}"])
def test_timeout_s_is_validated_alike_in_both_sections(section):
    for bad in ("0", "-1", ".inf", "soon"):
        with pytest.raises(ConfigError, match="timeout_s"):
            load_config(None, [section % bad])
    for good, want in (("2", 2.0), ("null", None), ("auto", "auto")):
        cfg = load_config(None, [section % good])
        got = cfg.rewards[0].timeout_s if section.startswith("rewards") else cfg.crosscheck.timeout_s
        assert got == want
