"""Memory planner: estimate a run's peak memory from the model's config and ours, and apply the
order of cuts of the practitioner's rule "memory order" (docs/training.md, "Practitioner's rules")
until it fits a budget:

    gradient checkpointing -> LoRA -> 4-bit base weights -> reference offload to CPU -> smaller G

Pure estimation: the model is instantiated on the `meta` device (no weights, no memory) to count
parameters per module exactly; everything else is arithmetic over its shape. docs/memory.md gives
every formula and the table that validates them against measured peaks (grpokit.train.memory_probe).

Phases of a training step, each a sum of what is alive at its peak (bytes):

    rollout  = weights + reference + grads + optimizer + KV cache + sampling logits
    logprobs = weights + reference + grads + optimizer + one layer's no-grad working set + logits chunk
    update   = weights + reference + optimizer + activations + head logits + grads (see `update_peak`)

Grads and optimizer states exist from the second step on (the optimizer creates its state at the
first step; gradients stay allocated between steps). The peak is the largest phase plus a runtime
overhead (CPU: the Python process with torch and transformers loaded; GPU: the CUDA context, which
`torch.cuda.max_memory_allocated` does not see).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

MiB, GiB = 2**20, 2**30

# Resident memory of a CPU training process besides the tensors counted below: Python, torch,
# transformers, grpokit, tokenizer and data (about 360 MiB once the trainer is built, measured on
# Linux x86-64 with torch 2.13 and transformers 5.18) plus about 40 MiB that the first backward pass
# adds (autograd engine, thread pools, allocator caches). Pass another value where the stack differs.
CPU_RUNTIME_BYTES = 400 * MiB
# peft and bitsandbytes add their modules and native libraries when LoRA / 4-bit is used.
CPU_PEFT_BYTES = 50 * MiB
CPU_BNB_BYTES = 30 * MiB
CUDA_CONTEXT_BYTES = 500 * MiB
LOGITS_BUDGET = 256 << 20          # grpokit.train.logprobs: above this the head runs under checkpointing


@dataclass
class Shape:
    """What the estimate needs to know about a model (from its HF config)."""
    model_type: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    params: int                                   # unique parameters
    linears: dict[str, tuple[int, int]]           # decoder nn.Linear name -> (in, out), lm_head excluded
    head_params: int                              # an untied LM head (0 when tied)

    @property
    def linear_params(self) -> int:
        return sum(i * o for i, o in self.linears.values())


def shape_from_config(hf_config) -> Shape:
    """Count parameters per module by building the model on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    c = copy.deepcopy(hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(c)
    tc = getattr(c, "get_text_config", lambda: c)()
    head = model.get_output_embeddings()
    tied = bool(getattr(tc, "tie_word_embeddings", False))
    linears = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and m is not head}
    heads = tc.num_attention_heads
    return Shape(
        model_type=getattr(tc, "model_type", ""), vocab=tc.vocab_size, hidden=tc.hidden_size,
        layers=tc.num_hidden_layers, heads=heads, kv_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        intermediate=getattr(tc, "intermediate_size", None) or 4 * tc.hidden_size, tied=tied,
        params=sum(p.numel() for p in model.parameters()),
        linears=linears, head_params=0 if tied or head is None else head.weight.numel())


def load_shape(model_path: str, gguf_file: str = "") -> Shape:
    from transformers import AutoConfig

    from grpokit.models.gguf import resolve_model_dir
    from grpokit.models.hf import ModelLoadError, _check_dir

    p = _check_dir(resolve_model_dir(model_path, gguf_file))
    if not (p / "config.json").is_file():
        from grpokit.models.lora import resolve_base
        p = resolve_base(p)
    try:
        return shape_from_config(AutoConfig.from_pretrained(p, local_files_only=True))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{p}: cannot read the model config ({str(exc).splitlines()[0]})") from None


@dataclass
class Setup:
    """The knobs of a run that memory depends on (read from a Config by `setup_from_config`)."""
    device: str = "cpu"                      # "cpu" or "cuda"
    dtype_bytes: int = 4
    grad_ckpt: bool = False
    lora: bool = False
    rank: int = 16
    targets: list[str] | str = "auto"
    four_bit: bool = False
    double_quant: bool = True
    reference: str = "copy"                  # "copy", "adapter_off" or "none"
    ref_device: str = "same"                 # "same", "cpu" or "swap"
    group_size: int = 16
    batch_size: int = 64
    wide_rounds: int = 1                     # dynamic sampling sized by the keep rate: one generation may
                                             # draw up to max_sampling_rounds x the step's prompts
    prompt_tokens: int = 256
    max_new_tokens: int = 2048
    micro_batch: int = 16
    chunk_tokens: int = 1024
    temperature: float = 1.0
    world_size: int = 1                      # data-parallel ranks (docs/distributed.md)
    distributed: str = "none"                # "none", "ddp" or "fsdp2"
    judges: float = 0.0                      # bytes of judge models (rewards, eval.checker) on this device


def setup_from_config(cfg, *, device: str | None = None, prompt_tokens: int = 256, world_size: int = 1) -> Setup:
    import torch

    from grpokit.rewards.judges import judge_bytes_of

    dev = device or ("cuda" if cfg.model.device.startswith("cuda") or
                     (cfg.model.device == "auto" and torch.cuda.is_available()) else "cpu")
    dtype = cfg.model.dtype
    nbytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 2 if dev == "cuda" else 4)
    lc, k = cfg.lora, cfg.algorithm.kl
    ref = "none" if k.beta == 0 and k.measure_every == 0 else ("adapter_off" if lc.enabled and lc.reference == "adapter_off" else "copy")
    return Setup(device=dev, dtype_bytes=nbytes, grad_ckpt=cfg.model.gradient_checkpointing, lora=lc.enabled,
                 rank=lc.rank, targets=lc.target_modules, four_bit=lc.enabled and lc.load_in_4bit,
                 double_quant=lc.double_quant, reference=ref, ref_device=k.ref_device,
                 group_size=cfg.rollout.group_size, batch_size=cfg.rollout.batch_size, prompt_tokens=prompt_tokens,
                 wide_rounds=(cfg.rollout.max_sampling_rounds if cfg.rollout.dynamic_sampling
                              and cfg.rollout.dynamic_width == "keep_rate" else 1),
                 max_new_tokens=cfg.rollout.max_new_tokens, micro_batch=cfg.optim.micro_batch_size,
                 chunk_tokens=cfg.optim.logprob_chunk, temperature=cfg.rollout.temperature,
                 world_size=world_size, distributed=_distributed_mode(cfg.train.distributed, world_size, cfg.lora),
                 judges=judge_bytes_of(cfg, dev))



def _distributed_mode(setting: str, world_size: int, lora=None) -> str:
    from grpokit.train.distributed import resolve_mode
    return resolve_mode(setting, world_size, lora)


@dataclass
class Estimate:
    shape: Shape
    setup: Setup
    parts: dict[str, float]                  # named terms, bytes
    phases: dict[str, float] = field(default_factory=dict)
    peak: float = 0.0                        # bytes, overhead included
    peak_phase: str = ""


def _lora_targets(shape: Shape, targets) -> dict[str, tuple[int, int]]:
    from grpokit.models.lora import target_modules_for

    t = target_modules_for(shape.model_type, targets)
    if t == "all-linear":
        return dict(shape.linears)
    names = [t] if isinstance(t, str) else list(t)
    return {n: io for n, io in shape.linears.items() if n.rsplit(".", 1)[-1] in names}


def weight_bytes(shape: Shape, s: Setup) -> tuple[float, float, int]:
    """(base weights, adapter weights, trainable parameters)."""
    b = s.dtype_bytes
    base = shape.params * b
    if s.four_bit:      # decoder linears in 4 bit + absmax per 64-value block (double quant: 8-bit absmax)
        q = shape.linear_params
        per = 0.5 + (1 / 64 + 4 / (64 * 256) if s.double_quant else 4 / 64)
        codes = len(shape.linears) * (16 + (256 if s.double_quant else 0)) * 4    # code books per layer
        base = (shape.params - q) * b + q * per + codes
    if not s.lora:
        return base, 0.0, shape.params
    n_lora = sum(s.rank * (i + o) for i, o in _lora_targets(shape, s.targets).values())
    return base, n_lora * 4.0, n_lora        # peft keeps adapters in float32


def layer_activation_bytes(shape: Shape, b: int) -> float:
    """Saved-for-backward bytes per token of one decoder layer (HF Llama/Qwen2 code path):
    two RMSNorms with their input (fp32 internally: (4 + 2b) h each), q/k/v with RoPE
    (3 h_q + 3 kv + kv), attention output and its reshaped copy (2 h_q), SwiGLU MLP (4 i)."""
    hq, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return 2 * (4 + 2 * b) * shape.hidden + (5 * hq + 4 * kv + 4 * shape.intermediate) * b


def update_terms(shape: Shape, s: Setup) -> dict[str, float]:
    """Activations and head logits of one micro-batch of the update (worst case: every completion
    at max_new_tokens, every prompt at prompt_tokens)."""
    b = s.dtype_bytes
    m = min(s.micro_batch, s.batch_size)
    S, L = s.prompt_tokens + s.max_new_tokens, s.max_new_tokens
    t = m * S
    per_layer = layer_activation_bytes(shape, b)
    mask = m * S * S                                         # the 4D boolean attention mask
    if s.grad_ckpt:        # layer inputs kept; one layer's activations during its recompute
        act = shape.layers * t * shape.hidden * b + t * per_layer
    else:
        act = shape.layers * t * per_layer
    act += t * (4 + 2 * b) * shape.hidden + mask             # final norm
    full = m * L * shape.vocab * 4.0                         # fp32 log-softmax input of the whole micro-batch
    ckpt_head = full > LOGITS_BUDGET
    one_shot = not ckpt_head and m * L <= s.chunk_tokens * 4
    chunk = full if one_shot else min(full, max(1, s.chunk_tokens // m) * m * shape.vocab * 4.0)
    saved = 0.0 if ckpt_head else full
    transient = 2 * chunk + (chunk * 2 / 4 if b == 2 else 0)   # softmax + product for the entropy (+ bf16 head output)
    return {"activations": act, "logits_saved": saved, "logits_transient": transient}


def kv_cache_bytes(shape: Shape, s: Setup) -> float:
    """K and V for every layer, the widest generation's completions (G x prompts, times
    `wide_rounds`), prompt + max_new_tokens positions."""
    S = s.prompt_tokens + s.max_new_tokens
    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * s.dtype_bytes
    rows = s.batch_size * s.wide_rounds
    return rows * S * per_token * (1 + 1 / max(shape.layers, 1))   # + one layer being concatenated


def sharded_working_set(shape: Shape, b: int) -> float:
    """FSDP2's gathered parameters during a forward or backward pass: the root unit (embedding,
    final norm, LM head: kept gathered through the pass) plus two decoder layers (the one running
    and the next one being prefetched)."""
    per_layer = shape.linear_params / max(shape.layers, 1) + 2 * shape.hidden     # + its two norms
    root = max(shape.params - shape.layers * per_layer, 0)
    return (root + 2 * per_layer) * b


def estimate(shape: Shape, s: Setup) -> Estimate:
    """Peak memory (bytes) of one device that holds the policy, and its parts. With `s.world_size`
    ranks each holds batch_size / world_size completions; FSDP2 also divides weights, gradients and
    both AdamW moments by the world size, gathers one layer at a time in the update and every
    weight at once for generation (docs/distributed.md, "Memory per rank"); the reference is a full
    copy on each rank, placed per `ref_device`. Judge models (`reward_model`, `llm_judge`) on the
    same device stay resident through every phase (`judges`)."""
    est = _estimate_per_rank(shape, s) if s.world_size > 1 or s.distributed != "none" else _estimate_one(shape, s)
    if s.judges:
        est.parts["judges"] = s.judges
        est.phases = {k: v + s.judges for k, v in est.phases.items()}
        est.peak += s.judges
    return est


def _estimate_one(shape: Shape, s: Setup) -> Estimate:
    b = s.dtype_bytes
    base, adapters, trainable = weight_bytes(shape, s)
    train_b = 4 if s.lora else b                             # grads and AdamW moments in the param dtype
    grads = trainable * train_b
    optim = 2 * trainable * train_b
    ref_w = 0.0
    if s.reference == "copy":
        ref_w = base if not s.lora else weight_bytes(shape, Setup(**{**s.__dict__, "lora": False}))[0]
    ref_on_dev = ref_w if (s.ref_device == "same" or s.device == "cpu") else 0.0
    up = update_terms(shape, s)
    kv = kv_cache_bytes(shape, s)
    weights = base + adapters
    resident = weights + ref_on_dev + optim
    N, V = s.batch_size, shape.vocab
    m = min(s.micro_batch, s.batch_size)
    S = s.prompt_tokens + s.max_new_tokens
    sample_logits = 4 * N * s.wide_rounds * V * 4.0          # logits, scaled, softmax, cumsum for top-p
    nograd_layer = 2 * m * S * (shape.hidden + 2 * shape.intermediate) * b
    nograd_logits = min(m * s.max_new_tokens, s.chunk_tokens * 4) * V * 4.0 * 2
    swap_in = ref_w if (s.ref_device == "swap" and s.device == "cuda") else 0.0
    if s.micro_batch < s.batch_size:       # later micro-batches run with the earlier ones' grads alive
        upd = resident + grads + up["activations"] + up["logits_saved"] + up["logits_transient"]
    else:                                   # one micro-batch: activations are freed as grads appear
        upd = resident + max(up["activations"] + up["logits_saved"] + up["logits_transient"], grads)
    phases = {
        "rollout": resident + grads + kv + sample_logits,
        "logprobs": resident + grads + swap_in + nograd_layer + nograd_logits,
        "update": upd,
    }
    overhead = (CUDA_CONTEXT_BYTES if s.device == "cuda" else
                CPU_RUNTIME_BYTES + (CPU_PEFT_BYTES if s.lora else 0) + (CPU_BNB_BYTES if s.four_bit else 0))
    parts = {"weights": base, "adapters": adapters, "reference": ref_w, "grads": grads, "optimizer": optim,
             "activations": up["activations"], "logits": up["logits_saved"] + up["logits_transient"],
             "kv_cache": kv, "overhead": overhead}
    phase = max(phases, key=phases.get)
    return Estimate(shape, s, parts, phases, phases[phase] + overhead, phase)


def estimate_config(cfg, *, device: str | None = None, prompt_tokens: int | None = None) -> Estimate:
    """Estimate for a Config (model shape read from cfg.model.path)."""
    shape = load_shape(cfg.model.path, cfg.model.gguf_file)
    pt = prompt_tokens if prompt_tokens is not None else prompt_tokens_of(cfg)
    return estimate(shape, setup_from_config(cfg, device=device, prompt_tokens=pt))


def prompt_tokens_of(cfg, *, limit: int = 2000, default: int = 256) -> int:
    """Longest prompt in tokens among the first `limit` rows of data.path (`default` when data.path
    is unset or the model has no tokenizer to count with). A data.path that is set but cannot be
    read is the user's error (DataError), not a reason to plan with a made-up length."""
    from grpokit.data.datasets import load_prompts
    from grpokit.models import load_tokenizer
    from grpokit.train.prompts import PromptEncoder

    if not cfg.data.path:
        return default
    ds = load_prompts(cfg.data.path, prompt_field=cfg.data.prompt_field, answer_field=cfg.data.answer_field)
    try:
        enc = PromptEncoder(load_tokenizer(cfg.model.path, gguf_file=cfg.model.gguf_file), cfg.data.chat_template)
        return max(len(enc.encode(r["prompt"])) for r in ds.rows[:limit])
    except Exception:  # noqa: BLE001 - no tokenizer at hand: a stated default
        return default


def parse_size(text: str) -> float:
    """'24GiB', '24G', '512MiB', '1.5TB' -> bytes (GB and GiB both mean 2**30 here, as GPU specs do)."""
    t = text.strip().lower().replace(" ", "").removesuffix("b").removesuffix("i")
    mult = {"k": 2**10, "m": MiB, "g": GiB, "t": 2**40}
    try:
        if t and t[-1] in mult:
            return float(t[:-1]) * mult[t[-1]]
        return float(t)
    except ValueError:
        from grpokit.config import ConfigError
        raise ConfigError(f"--budget {text!r}: give a size like 24GiB or 512MiB") from None


def default_budget(device: str) -> float:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    try:
        import os
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return math.inf


def _estimate_per_rank(shape: Shape, s: Setup) -> Estimate:
    """`estimate` for one of `s.world_size` data-parallel ranks (see there)."""
    import dataclasses

    N = max(s.world_size, 1)
    if s.batch_size % (N * s.group_size):
        raise ValueError(f"batch_size {s.batch_size} does not split into whole groups of {s.group_size} over {N} ranks")
    local = dataclasses.replace(s, batch_size=s.batch_size // N, world_size=1, distributed="none")
    one = estimate(shape, local)                      # a single process on this rank's share of the batch
    if s.distributed != "fsdp2":
        return one
    p = dict(one.parts)
    full = p["weights"] + p["adapters"]
    cut = (1 - 1 / N) * (full + p["grads"] + p["optimizer"])       # what the other ranks hold
    gathered = sharded_working_set(shape, s.dtype_bytes)
    # generation gathers every weight at once, besides this rank's shards
    phases = {"rollout": one.phases["rollout"] - (1 - 1 / N) * (p["grads"] + p["optimizer"]) + full / N,
              "logprobs": one.phases["logprobs"] - cut + gathered,
              "update": one.phases["update"] - cut + gathered}
    for k in ("weights", "adapters", "grads", "optimizer"):
        p[k] = p[k] / N
    p["gathered"] = gathered
    phase = max(phases, key=phases.get)
    return Estimate(shape, s, p, phases, phases[phase] + p["overhead"], phase)
