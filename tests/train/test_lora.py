"""LoRA / QLoRA GRPO: the adapter-off reference is the base model exactly, only adapters train,
adapter and merged saves load back (also through `grpokit eval`), resume, the reference cache."""

import json

import pytest
import torch

from grpokit.config import load_config
from grpokit.train import build_trainer
from grpokit.train import forward as lean_forward
from grpokit.models.lora import four_bit_unavailable, merged_state_dict
from grpokit.train.batch import from_rollout
from grpokit.models import load_model
from grpokit.train.logprobs import padded_logprobs
from grpokit.train.reference import RefLogprobCache
from tests.fixtures import arithmetic_files, small_overrides, tiny_model_dir

LORA = {"lora.enabled": True, "lora.rank": 4, "lora.alpha": 8, "algorithm.kl.beta": 0.05,
        "algorithm.kl.controller": "fixed", "rewards": "[{name: test_varied}]", "optim.lr": 5e-2}
HAS_4BIT = four_bit_unavailable("cpu") is None


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model_dir = tiny_model_dir(root / "model")
    train, held = arithmetic_files(root / "data")
    return root, model_dir, train, held


def _trainer(setup, name, **extra):
    root, model_dir, train, _ = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / name, **{**LORA, **extra}))
    torch.manual_seed(0)
    return build_trainer(cfg, health=False)


def _batch(tr):
    rows = [tr.dataset[i] for i in range(4)]
    return from_rollout(tr.sample(rows), list(range(4)), rows, tr.cfg.rollout.group_size)


def _logprobs(tr, model, batch):
    """[B, T] log-probs of `batch` under any `model`, cut into the worker's micro-batches."""
    return padded_logprobs(model, tr.worker.plan(batch, list(range(len(batch)))), tuple(batch.mask.shape),
                           temperature=tr.cfg.rollout.temperature)


def _adapters(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _base(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def test_adapter_off_reference_equals_base_model_exactly_before_and_after_updates(setup):
    _, model_dir, _, _ = setup
    tr = _trainer(setup, "ref_exact")
    assert tr.reference.adapters_off and tr.reference.module is tr.model   # no second copy of the weights
    base = load_model(model_dir, dtype="float32", device="cpu")
    batch = _batch(tr)
    for step in range(3):
        ref = tr.worker.logprobs(batch, "reference")
        assert lean_forward.supports(base)     # both sides on the lean forward: the same operations
        want = _logprobs(tr, base, batch)
        assert torch.equal(ref, want), f"step {step}"
        tr.step()
        tr.step_idx += 1
    pol = tr.worker.logprobs(batch, "policy")                         # the policy itself did move
    assert float((pol - want).abs().max()) > 1e-4


def test_lora_grpo_trains_only_the_adapters(setup):
    tr = _trainer(setup, "only_adapters", **{"train.steps": 3})
    trained = {id(p) for g in tr.worker.optimizer.param_groups for p in g["params"]}
    named = dict(tr.model.named_parameters())
    assert trained == {id(p) for n, p in named.items() if "lora_" in n}
    base0, ad0 = _base(tr.model), _adapters(tr.model)
    last = tr.train()
    assert last["optim/grad_norm"] > 0 and "kl/ref" in last
    for n, v in _base(tr.model).items():
        assert torch.equal(v, base0[n]), n
    moved = [n for n, v in _adapters(tr.model).items() if not torch.equal(v, ad0[n])]
    assert any("lora_B" in n for n in moved)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("save", ["adapter", "merged"])
def test_saves_load_back_and_evaluate(setup, save, capsys):
    root, model_dir, train, held = setup
    tr = _trainer(setup, f"save_{save}", **{"train.steps": 2, "lora.save": save})
    tr.train()
    ck = root / f"save_{save}" / "checkpoints" / "step_000002"
    files = {p.name for p in ck.iterdir()}
    if save == "adapter":
        assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "config.json" not in files
        base_path = json.loads((ck / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert base_path == str(model_dir.resolve())
    else:
        assert {"config.json", "model.safetensors", "adapter"} <= files
        from transformers import AutoModelForCausalLM
        plain = AutoModelForCausalLM.from_pretrained(ck)                  # no peft involved
        assert type(plain).__name__ == "Qwen2ForCausalLM"
    loaded = load_model(ck, dtype="float32", device="cpu")
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    torch.testing.assert_close(_logits(loaded, ids), _logits(tr.model, ids), atol=1e-5, rtol=1e-5)

    from grpokit.cli import main
    rc = main(["eval", "--model", str(ck), "--data", str(held), "rewards=[{name: exact_match}]",
               "rollout.max_new_tokens=4"])
    assert rc == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["prompts"] > 0


def test_merged_state_dict_folds_the_adapters_in(setup):
    tr = _trainer(setup, "merge_math", **{"train.steps": 1})
    tr.train()
    sd = merged_state_dict(tr.model)
    layer = tr.model.get_base_model().model.layers[0].self_attn.q_proj
    want = layer.base_layer.weight + layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(sd["model.layers.0.self_attn.q_proj.weight"], want)
    assert not any("lora_" in k or "base_layer" in k for k in sd)


@pytest.mark.parametrize("save", ["adapter", "merged"])
def test_lora_resume_continues_exactly(setup, save):
    common = {"train.save_every": 2, "lora.save": save}
    straight = _trainer(setup, f"straight_{save}", **common, **{"train.steps": 4})
    straight.train()
    _trainer(setup, f"resumed_{save}", **common, **{"train.steps": 2}).train()
    resumed = _trainer(setup, f"resumed_{save}", **common, **{"train.steps": 4})
    resumed.train(resume=True)
    a, b = _adapters(straight.model), _adapters(resumed.model)
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=1e-6, rtol=1e-5)


def test_reference_cache_counts_hits_and_evicts():
    cache = RefLogprobCache(capacity=3)
    calls = []

    def compute(rows):
        calls.append(list(rows))
        return {r: torch.tensor([float(r)]) for r in rows}

    k = RefLogprobCache.key
    # rows 0 and 2 share a key: computed once, so 1 of 3 lookups is a hit
    out = cache.fetch({0: k([1], [5]), 1: k([1], [6]), 2: k([1], [5])}, compute)
    assert calls == [[0, 1]] and torch.equal(out[2], out[0])
    assert cache.metrics()["ref/cache_hit_rate"] == pytest.approx(1 / 3)
    # both keys seen before: 2 hits of 2, nothing computed
    cache.fetch({0: k([1], [6]), 1: k([1], [5])}, compute)
    assert len(calls) == 1 and cache.metrics()["ref/cache_hit_rate"] == 1.0
    assert cache.metrics()["ref/cache_hit_rate_total"] == pytest.approx(3 / 5)
    # capacity 3: two new keys evict the least recently used one ([1],[6] was used before [1],[5])
    cache.fetch({0: k([2], [1]), 1: k([2], [2])}, compute)
    assert len(cache.store) == 3 and k([1], [6]) not in cache.store and k([1], [5]) in cache.store


def test_trainer_reference_cache_matches_uncached_logprobs(setup):
    tr = _trainer(setup, "cache", **{"algorithm.kl.ref_cache": 1000})
    batch = _batch(tr)
    plain = tr.worker.logprobs(batch, "reference", dropout=False)      # dropout off: never cached
    first = tr.worker.logprobs(batch, "reference")
    again = tr.worker.logprobs(batch, "reference")
    assert tr.reference.metrics()["ref/cache_hit_rate"] == 1.0
    torch.testing.assert_close(first, plain, atol=1e-6, rtol=0)
    assert torch.equal(again, first)
    m = tr.step()
    assert 0.0 <= m["ref/cache_hit_rate"] <= 1.0 and m["ref/cache_entries"] > 0


def test_auto_cache_is_on_by_default_and_let_go_when_nothing_repeats(setup):
    """`ref_cache: auto` (the default): kept while samples repeat, released after its trial passes
    when they do not; the log-probs equal the uncached ones either way."""
    from grpokit.train.batch import select
    from grpokit.train.reference import AUTO_TRIAL_CALLS

    tr = _trainer(setup, "cache_auto")
    assert tr.reference.cache is not None and tr.reference.cache_auto
    batch = _batch(tr)
    plain = tr.worker.logprobs(batch, "reference", dropout=False)
    for _ in range(AUTO_TRIAL_CALLS):                       # the same samples again and again: hits
        torch.testing.assert_close(tr.worker.logprobs(batch, "reference"), plain, atol=1e-6, rtol=0)
    assert tr.reference.cache is not None and tr.reference.metrics()["ref/cache_hit_rate"] == 1.0
    # a fresh trainer sees only new samples: each call a row it has not seen (its own prompt/completion)
    tr = _trainer(setup, "cache_auto_miss")
    batch = _batch(tr)
    distinct = {}
    for r in range(len(batch)):
        distinct.setdefault(tuple(batch.completion_ids[r].tolist()) + tuple(batch.prompt_ids[r]), r)
    rows = sorted(distinct.values())
    assert len(rows) >= AUTO_TRIAL_CALLS, "the sampled batch repeats itself too much for this test"
    for r in rows[:AUTO_TRIAL_CALLS]:
        one = select(batch, [r])
        torch.testing.assert_close(tr.worker.logprobs(one, "reference"),
                                   tr.worker.logprobs(one, "reference", dropout=False), atol=1e-6, rtol=0)
    assert tr.reference.cache is None and tr.reference.metrics() == {"ref/cache_entries": 0.0}
    # a number is kept whatever its hit rate
    tr = _trainer(setup, "cache_fixed", **{"algorithm.kl.ref_cache": 64})
    batch = _batch(tr)
    for r in range(AUTO_TRIAL_CALLS):
        tr.worker.logprobs(select(batch, [r]), "reference")
    assert tr.reference.cache is not None


def test_reference_copy_on_cpu(setup):
    tr = _trainer(setup, "refcpu", **{"lora.enabled": False, "algorithm.kl.ref_device": "cpu", "optim.lr": 1e-3})
    assert tr.reference.module is not tr.model and next(tr.reference.module.parameters()).device.type == "cpu"
    tr.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only path: a reference off the policy's GPU")
@pytest.mark.parametrize("where", ["cpu", "swap"])
def test_reference_offload_on_gpu(setup, where):
    tr = _trainer(setup, f"ref_{where}", **{"lora.enabled": False, "model.device": "cuda",
                                            "algorithm.kl.ref_device": where, "optim.lr": 1e-3})
    assert next(tr.model.parameters()).is_cuda and next(tr.reference.module.parameters()).device.type == "cpu"
    batch = _batch(tr)
    ref = tr.worker.logprobs(batch, "reference")
    pol = tr.worker.logprobs(batch, "policy")            # the same weights: the same log-probs
    torch.testing.assert_close(ref, pol, atol=1e-4, rtol=1e-4)
    assert next(tr.reference.module.parameters()).device.type == "cpu"


def test_4bit_error_names_what_is_missing(setup, monkeypatch, capsys):
    import builtins
    real_import = builtins.__import__

    def no_bnb(name, *a, **k):
        if name == "bitsandbytes" or name.startswith("bitsandbytes."):
            raise ImportError("No module named 'bitsandbytes'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_bnb)
    msg = four_bit_unavailable("cpu")
    assert msg is not None and "bitsandbytes" in msg and "\n" not in msg
    root, model_dir, train, _ = setup
    from grpokit.cli import main
    rc = main(["train", *small_overrides(model_dir, train, root / "no4bit", **{**LORA, "lora.load_in_4bit": True})])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "bitsandbytes" in err[0]


@pytest.mark.skipif(not HAS_4BIT, reason="bitsandbytes 4-bit is not available on this platform")
def test_qlora_trains_with_an_exact_adapter_off_reference(setup):
    tr = _trainer(setup, "qlora", **{"lora.load_in_4bit": True, "train.steps": 2, "lora.save": "merged"})
    assert getattr(tr.model.get_base_model(), "is_loaded_in_4bit", False)
    batch = _batch(tr)
    ref0 = tr.worker.logprobs(batch, "reference")
    ad0 = _adapters(tr.model)
    tr.train()
    assert any(not torch.equal(v, ad0[n]) for n, v in _adapters(tr.model).items())
    ref1 = tr.worker.logprobs(batch, "reference")
    assert torch.equal(ref0, ref1)
    # the merged save is a plain full-precision model equal to the 4-bit policy up to rounding
    ck = tr.run_dir / "checkpoints" / "step_000002"
    assert "quantization_config" not in json.loads((ck / "config.json").read_text())
    plain = load_model(ck, dtype="float32", device="cpu")
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    torch.testing.assert_close(_logits(plain, ids), _logits(tr.model, ids), atol=1e-3, rtol=1e-3)
    adapters_only = load_model(ck / "adapter", dtype="float32", device="cpu")      # 4-bit base + adapters
    torch.testing.assert_close(_logits(adapters_only, ids), _logits(tr.model, ids), atol=1e-5, rtol=1e-5)
