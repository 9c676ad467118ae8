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
    assert a.loss_agg == "token_mean" and a.mask_truncated and a.kl.beta == 0.0 and cfg.rollout.dynamic_sampling
    assert load_config("dapo").algorithm.eps_high == 0.28              # dapo itself keeps the paper's value
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
    assert both.algorithm.eps_high == 2.0 and both.rollout.dynamic_sampling and both.algorithm.kl.beta == 0.0
