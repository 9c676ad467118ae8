"""LoRA and QLoRA policies (practitioner's rules "LoRA-GRPO" and "memory order", docs/training.md):
adapters through `peft`, 4-bit base weights through `bitsandbytes`, adapter-only and merged saves,
and loading either back for evaluation.

The reference of a LoRA run is the policy itself with its adapters disabled
(`grpokit.train.reference.Reference.of_adapters_off`): no second copy of the weights. Its log-probs equal the base model's
exactly because the base weights are frozen and never touched; merged saves are therefore built as
a separate state dict (W + (alpha / r) * B @ A) instead of merging in place, which would perturb W
by rounding when unmerged.

Departures from the QLoRA paper (arXiv 2305.14314): no paged optimizer, and non-quantized weights
(embeddings, norms) are not up-cast to float32 (peft's `prepare_model_for_kbit_training` does so),
to keep the memory the planner promises.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch

from grpokit.models.hf import ModelLoadError, _check_dir, load_model, resolve_device, resolve_dtype

# bitsandbytes logs a warning at import on CPUs with AVX512-BF16 when the optional `kernels`
# package is absent; it then uses its own (slower) kernel, which is fine for us.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

log = logging.getLogger("grpokit.models")

# Modules that get adapters with `lora.target_modules: auto`: every attention and MLP projection
# (QLoRA paper: adapters on all linear layers matter more than the rank). Others: peft's "all-linear".
_LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_TARGETS: dict[str, list[str]] = {
    **{t: _LLAMA_LIKE for t in ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text",
                                "olmo", "olmo2", "granite", "smollm3", "cohere")},
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "phi": ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "starcoder2": ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"],
}
ADAPTER_MARKER = "grpokit_lora.json"   # in an adapter save: how the base was loaded (4-bit or not)


def target_modules_for(model_type: str, setting: list[str] | str = "auto") -> list[str] | str:
    """The `target_modules` passed to peft for a model type and the `lora.target_modules` setting."""
    if setting != "auto":
        return setting
    return DEFAULT_TARGETS.get(model_type, "all-linear")


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


# --------------------------------------------------------------------------- 4-bit


def four_bit_unavailable(device: torch.device | str) -> str | None:
    """None when bitsandbytes can quantize to 4 bit on `device` here, else one line saying what is
    missing. A tiny quantize/dequantize round trip decides, so the answer follows the installed
    release (bitsandbytes >= 0.48 has CPU 4-bit kernels; it needs AVX2 on x86)."""
    dev = torch.device(device)
    try:
        import bitsandbytes as bnb
    except ImportError:
        return "lora.load_in_4bit needs bitsandbytes, which is not installed (pip install 'grpokit[qlora]')"
    except Exception as exc:  # noqa: BLE001 - a broken native library raises anything
        return f"lora.load_in_4bit: bitsandbytes cannot be imported here ({str(exc).splitlines()[0][:160]})"
    try:
        x = torch.randn(64, 64, device=dev)
        q, state = bnb.functional.quantize_4bit(x, quant_type="nf4")
        back = bnb.functional.dequantize_4bit(q, state, quant_type="nf4")
        if not torch.isfinite(back).all() or float((back - x).abs().max()) > 1.0:
            raise RuntimeError("4-bit round trip is wrong")
    except Exception as exc:  # noqa: BLE001
        msg = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        return (f"lora.load_in_4bit: bitsandbytes {getattr(bnb, '__version__', '?')} has no working 4-bit "
                f"kernels for device '{dev.type}' here ({msg})")
    return None


def quantization_config(lcfg, compute_dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=lcfg.quant_type,
                              bnb_4bit_use_double_quant=lcfg.double_quant, bnb_4bit_compute_dtype=compute_dtype)


def load_4bit_model(path: str | Path, lcfg, *, dtype: str = "auto", device: str = "auto",
                    gradient_checkpointing: bool = False, trust_remote_code: bool = False):
    """The base model with its linear layers in 4 bit (QLoRA); embeddings, norms and the LM head
    stay in the compute dtype. Raises ModelLoadError with one line when 4-bit cannot run here."""
    from transformers import AutoModelForCausalLM

    p = _check_dir(path)
    dev = resolve_device(device)
    missing = four_bit_unavailable(dev)
    if missing:
        raise ModelLoadError(missing)
    dt = resolve_dtype(dtype, dev)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            p, dtype=dt, quantization_config=quantization_config(lcfg, dt), device_map={"": str(dev)},
            local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"{p}: cannot load the model in 4 bit ({str(exc).splitlines()[0]})") from None
    _keep_trainable_layout(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def _keep_trainable_layout(model) -> None:
    """bitsandbytes >= 0.49 repacks a 4-bit weight into an inference-only CPU layout the first time
    the layer runs in eval mode without grad (on AVX512-BF16 CPUs); gradients no longer flow through
    it afterwards. The trainer keeps the policy in eval mode and samples without grad, so turn it off."""
    import bitsandbytes as bnb

    for mod in model.modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            mod.support_avx512bf16_for_cpu = False


# --------------------------------------------------------------------------- adapters


def wrap_lora(model, lcfg):
    """Freeze `model` and inject LoRA adapters (B = 0 at start, so the policy equals the base)."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules_for(getattr(model.config, "model_type", ""), lcfg.target_modules)
    pcfg = LoraConfig(r=lcfg.rank, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout, target_modules=targets,
                      bias="none", task_type="CAUSAL_LM")
    try:
        peft_model = get_peft_model(model, pcfg)
    except ValueError as exc:         # e.g. a target module that this architecture does not have
        raise ModelLoadError(f"lora.target_modules={targets!r}: {str(exc).splitlines()[0]}") from None
    peft_model.eval()                 # like the full fine-tune: the trainer runs the policy in eval mode
    return peft_model


# --------------------------------------------------------------------------- saving and loading


def _base_path(model) -> str:
    cfg = next(iter(model.peft_config.values()))
    return str(cfg.base_model_name_or_path or "")


def save_adapter(model, path: Path, state_dict: dict | None = None) -> None:
    """Adapters alone (adapter_model.safetensors + adapter_config.json). The base path recorded in
    adapter_config.json is made absolute, so `grpokit eval --model DIR` finds it from anywhere.
    `state_dict`: the model's state to take them from (e.g. copies of gathered FSDP2 shards)."""
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True, **({"state_dict": state_dict} if state_dict is not None else {}))
    cfg_file = path / "adapter_config.json"
    data = json.loads(cfg_file.read_text())
    base = data.get("base_model_name_or_path") or ""
    if base and Path(base).is_dir():
        data["base_model_name_or_path"] = str(Path(base).resolve())
        cfg_file.write_text(json.dumps(data, indent=2))
    four = bool(getattr(model.get_base_model(), "is_loaded_in_4bit", False))
    qc = getattr(model.get_base_model().config, "quantization_config", None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") else (qc or {})
    (path / ADAPTER_MARKER).write_text(json.dumps({
        "load_in_4bit": four, "quant_type": qc.get("bnb_4bit_quant_type", "nf4"),
        "double_quant": bool(qc.get("bnb_4bit_use_double_quant", False))}))


def _dequantized(weight) -> torch.Tensor:
    """A full-precision copy of a (possibly 4-bit) linear weight."""
    if getattr(weight, "quant_state", None) is not None:
        import bitsandbytes as bnb
        qs = weight.quant_state
        return bnb.functional.dequantize_4bit(weight.data, qs).to(qs.dtype)
    return weight.detach().clone()


@torch.no_grad()
def merged_state_dict(model, *, adapters: bool = True) -> dict[str, torch.Tensor]:
    """The base model's state dict, on the CPU, with every adapter folded in: W + scaling * B @ A
    (4-bit weights dequantized first, one layer at a time). The live model is not modified, so the
    adapter-off reference stays exact. `adapters=False`: the base weights alone (dequantized), what
    a rollout server that takes adapters folds them into (`adapter_update`)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    out: dict[str, torch.Tensor] = {}
    lora_prefixes = set()
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            lora_prefixes.add(name)
            layer = module.get_base_layer()
            w = _dequantized(layer.weight)
            for ad in module.active_adapters if adapters else ():
                if ad in module.lora_A:
                    delta = module.get_delta_weight(ad)           # [out, in], scaling included
                    w = w + delta.to(w.dtype)
            out[f"{name}.weight"] = w.contiguous().cpu()      # one layer at a time on the device
            if getattr(layer, "bias", None) is not None:
                out[f"{name}.bias"] = layer.bias.detach().to("cpu", copy=True)
    for name, module in base.named_modules():
        if any(name == p or name.startswith(p + ".") for p in lora_prefixes):
            continue
        for pname, prm in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            key = f"{name}.{pname}" if name else pname
            if key in out or (module._non_persistent_buffers_set and pname in module._non_persistent_buffers_set):
                continue
            out[key] = (_dequantized(prm) if getattr(prm, "quant_state", None) is not None else prm.detach()).to("cpu", copy=True)
    if getattr(getattr(base, "config", None), "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)                          # tied: saved once, as the embedding
    return {k: v.contiguous() for k, v in out.items()}


@torch.no_grad()
def adapter_update(model) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict]] | None:
    """The adapters alone, as a rollout server that takes them folds them in
    (grpokit.rollout.adapters): per adapted layer `NAME.lora_A` [r, in] and `NAME.lora_B` [out, r]
    (CPU copies, Hugging Face module names) and its spec: scale (alpha / r), fan_in_fan_out, and
    whether peft computes the delta through float32 (half-precision adapters on the CPU). None when
    the model's adapters are not plain low-rank products (DoRA, a LoRA bias, several active
    adapters, a layer type other than a linear one): those go merged."""
    from peft.tuners.lora import Linear, LoraLayer

    kinds: tuple = (Linear,)
    try:                                          # 4- and 8-bit layers: where bitsandbytes is installed
        from peft.tuners.lora import bnb as lora_bnb
        kinds += tuple(getattr(lora_bnb, k) for k in ("Linear4bit", "Linear8bitLt") if hasattr(lora_bnb, k))
    except ImportError:
        pass
    tensors: list[tuple[str, torch.Tensor]] = []
    specs: dict[str, dict] = {}
    for name, module in model.get_base_model().named_modules():
        if not isinstance(module, LoraLayer):
            continue
        active = [a for a in module.active_adapters if a in module.lora_A]
        if not active:
            continue
        ad = active[0]
        if (not isinstance(module, kinds) or len(active) > 1 or module.use_dora.get(ad)
                or getattr(module, "lora_bias", {}).get(ad)):
            return None
        A, B = module.lora_A[ad].weight, module.lora_B[ad].weight
        tensors += [(f"{name}.lora_A", A.detach().to("cpu", copy=True)), (f"{name}.lora_B", B.detach().to("cpu", copy=True))]
        specs[name] = {"scale": float(module.scaling[ad]), "fan_in_fan_out": bool(getattr(module, "fan_in_fan_out", False)),
                       "fp32": type(module) is Linear and B.device.type == "cpu" and B.dtype in (torch.float16, torch.bfloat16)}
    return (tensors, specs) if specs else None


def merged_copy(model, *, adapters: bool = True):
    """A plain transformers model of a PEFT model's base architecture holding its merged weights
    (`adapters=False`: its base weights alone), built out of place (the adapters stay), on the
    model's device."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.get_base_model().config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    merged = merged_state_dict(model, adapters=adapters)
    plain = AutoModelForCausalLM.from_config(config, dtype=next(iter(merged.values())).dtype)
    plain.load_state_dict(merged, strict=False)        # a tied LM head is not in the merged dict
    return plain.to(next(model.parameters()).device)

def save_merged(model, path: Path) -> None:
    """Adapters merged into the base, saved as a plain HF model directory (no peft needed to load)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model()
    state = merged_state_dict(model)
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dtypes = {v.dtype for k, v in state.items() if v.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = next(iter(dtypes))
    config.save_pretrained(path)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(path)
    save_file({k: v.cpu() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})


def save_policy(model, path: Path, *, merged: bool = False, state_dict: dict | None = None) -> None:
    """What a checkpoint holds for the policy. A plain model: `save_pretrained`. A LoRA model: its
    adapters; with `merged`, a plain merged model directory plus the adapters in `adapter/` (so that
    `--resume` can restore them). `state_dict`: the adapters' source, when not the live tensors."""
    path = Path(path)
    if not is_peft(model):
        model.save_pretrained(path, safe_serialization=True)
    elif merged:
        save_merged(model, path)
        save_adapter(model, path / "adapter", state_dict)
    else:
        save_adapter(model, path, state_dict)


def adapter_dir(ckpt: Path) -> Path | None:
    """Where a checkpoint keeps its adapters (the folder itself or its `adapter/`), if anywhere."""
    for d in (Path(ckpt), Path(ckpt) / "adapter"):
        if (d / "adapter_config.json").is_file():
            return d
    return None


def load_adapter_weights(model, ckpt: Path) -> None:
    """Load the adapters saved in a checkpoint into a LoRA `model`, in place."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    d = adapter_dir(ckpt)
    if d is None or not (d / "adapter_model.safetensors").is_file():
        raise FileNotFoundError(f"{ckpt}: no LoRA adapters (adapter_model.safetensors) in this checkpoint")
    state = load_file(str(d / "adapter_model.safetensors"))
    res = set_peft_model_state_dict(model, state)
    unexpected = [k for k in res.unexpected_keys if "lora_" in k]
    missing = [k for k in res.missing_keys if "lora_" in k]
    if unexpected or missing:
        raise RuntimeError(f"{ckpt}: adapters do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")


def resolve_base(adapter_path: Path) -> Path:
    """The base model directory named by an adapter save (absolute, or relative to the adapter)."""
    data = json.loads((Path(adapter_path) / "adapter_config.json").read_text())
    base = data.get("base_model_name_or_path") or ""
    for cand in (Path(base), Path(adapter_path) / base):
        if base and (cand / "config.json").is_file():
            return cand
    raise ModelLoadError(f"{adapter_path}: the base model of these adapters is not a local directory "
                         f"({base!r} in adapter_config.json); grpokit never downloads models")


def load_adapter_model(path: str | Path, *, dtype: str = "auto", device: str = "auto",
                       trust_remote_code: bool = False, merge: bool = True):
    """Base model + saved adapters, for evaluation. The base is loaded in 4 bit when it was trained
    so; otherwise the adapters are merged (plain, faster generation)."""
    from peft import PeftModel

    path = Path(path)
    base_dir = resolve_base(path)
    marker = path / ADAPTER_MARKER
    info = json.loads(marker.read_text()) if marker.is_file() else {}
    if info.get("load_in_4bit"):
        from types import SimpleNamespace
        lc = SimpleNamespace(quant_type=info.get("quant_type", "nf4"), double_quant=info.get("double_quant", True))
        base = load_4bit_model(base_dir, lc, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    else:
        base = load_model(base_dir, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    model = PeftModel.from_pretrained(base, str(path), is_trainable=False)
    if merge and not info.get("load_in_4bit"):
        model = model.merge_and_unload()
    model.eval()
    return model
