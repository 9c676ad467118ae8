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
