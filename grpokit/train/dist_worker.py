"""Data-parallel training workers: DDP and FSDP2 over the local worker's loss and micro-batches.

`DataParallelWorker` is `LocalWorker` (the same micro-batch plan, loss, guard and optimizer code)
with four changes, all needed for N ranks to compute the gradient one process computes on the
union of their batches:

- the loss normalisers (tokens, sequences of a mini-batch) are summed over the ranks, so each
  rank's loss is its share of the global loss; DDP and FSDP2 average gradients over ranks, so the
  backward pass scales the share by the world size (sum of shares = the global loss's gradient);
- every rank runs the same number of forward passes (FSDP2 gathers parameters in each, DDP
  synchronises gradients in each backward): a rank with fewer micro-batches runs empty ones whose
  loss is 0 (a zero gradient);
- a mini-batch is skipped by the non-finite guard on every rank together (an all-reduced flag);
- the forward pass goes through the wrapped module (`PolicyForward` under DDP or `fully_shard`), so
  the wrapper's hooks run.

FSDP2 (`torch.distributed.fsdp.fully_shard`): each decoder layer is one unit, the root unit holds
the rest (embedding, final norm and LM head, tied or not, together); on GPU parameters are cast to
bf16 for compute and gradients reduced in fp32. The reference stays a full, frozen copy on each
rank, placed per `algorithm.kl.ref_device` (no collectives in its forward pass).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from grpokit.train import checkpoint as ckpt_lib
from grpokit.models import sharded
from grpokit.train.distributed import DistContext, gathered
from grpokit.train.guard import NonFiniteStep
from grpokit.train.logprobs import MicroBatch, completion_logprobs, unwrap
from grpokit.models.lora import adapter_update, is_peft, merged_state_dict, save_policy
from grpokit.train.worker import LocalWorker

ROOT = "policy."      # the parameter-name prefix PolicyForward adds


class PolicyForward(torch.nn.Module):
    """The policy's log-prob forward as a module, so that DDP / FSDP2 wrap the call the worker makes
    (grpokit computes log-probs from the decoder and the LM head, not from the model's forward)."""

    def __init__(self, policy, temperature: float, chunk_tokens: int):
        super().__init__()
        self.policy = policy
        self.temperature, self.chunk_tokens = temperature, chunk_tokens

    def forward(self, mb: MicroBatch, want_entropy: bool = False):
        return completion_logprobs(self.policy, mb, temperature=self.temperature, chunk_tokens=self.chunk_tokens,
                                   want_entropy=want_entropy)


def _empty_micro_batch(pad_id: int) -> MicroBatch:
    """One row of two pad tokens with no completion token: a forward pass that changes nothing."""
    ids = torch.full((1, 2), pad_id, dtype=torch.long)
    return MicroBatch(rows=torch.zeros(0, dtype=torch.long), input_ids=ids, attention_mask=torch.ones_like(ids),
                      prompt_len=1, targets=ids[:, 1:], mask=torch.zeros((1, 1), dtype=torch.long))


def _is_empty(mb: MicroBatch) -> bool:
    return mb.rows.numel() == 0


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder's repeated blocks (FSDP2 units)."""
    m = unwrap(model)
    backbone = m.get_decoder() if hasattr(m, "get_decoder") else getattr(m, m.base_model_prefix)
    layers = getattr(backbone, "layers", None) or getattr(backbone, "h", None)
    if layers is None:
        raise ValueError(f"{type(m).__name__}: cannot find its decoder layers to shard")
    return list(layers)


class DataParallelWorker(LocalWorker):
    """A `TrainingWorker` for one rank of a DDP or FSDP2 job (module docstring)."""

    def __init__(self, cfg, model, tokenizer, reference, ctx: DistContext):
        self.ctx = ctx
        forward = PolicyForward(model, cfg.rollout.temperature, cfg.optim.logprob_chunk)
        if ctx.mode == "fsdp2":
            self.wrapped = self._shard(forward, model, cfg)
            super().__init__(cfg, model, tokenizer, reference)       # the optimizer over the shards
        elif ctx.mode == "ddp":
            super().__init__(cfg, model, tokenizer, reference)
            from torch.nn.parallel import DistributedDataParallel as DDP
            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            self.wrapped = DDP(forward, device_ids=ids)               # broadcasts rank 0's weights
        else:
            raise ValueError(f"unknown data-parallel mode {ctx.mode!r}")
        self._fsdp_units = [m for m in self.wrapped.modules() if hasattr(m, "unshard")] if ctx.mode == "fsdp2" else []
        # FSDP2 full fine-tuning checkpoints its shards with DCP (grpokit.models.sharded); LoRA saves
        # the (small) adapters gathered, DDP the full copy every rank holds
        self.sharded_checkpoints = ctx.mode == "fsdp2" and not is_peft(model)

    def _shard(self, forward: PolicyForward, model, cfg):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        ctx = self.ctx
        mesh = init_device_mesh(ctx.device.type, (ctx.world,))
        kw = {"mesh": mesh}
        if ctx.device.type == "cuda":        # bf16 compute, fp32 gradient reduction (GPU only)
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, **kw)
        return fully_shard(forward, **kw)    # root: embedding, norm, LM head (tied ones together)

    # ------------------------------------------------------------------ forward passes
    def forward(self, mb: MicroBatch, *, want_entropy: bool = False):
        return self.wrapped(mb, want_entropy)

    joins_every_pass = True

    def plan(self, batch, rows: list[int]) -> list[MicroBatch]:
        """The local plan, padded with empty micro-batches to the longest plan of any rank."""
        return self.pad_plan(super().plan(batch, rows) if rows else [])

    def pad_plan(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        """`mbs` padded with empty micro-batches to the longest list of any rank."""
        n = int(self.ctx.all_max(float(len(mbs))))
        return mbs + [_empty_micro_batch(self.pad_id) for _ in range(n - len(mbs))]

    def logprobs(self, batch, which: str = "policy", *, rows=None, dropout: bool = True) -> torch.Tensor:
        if which == "reference" and self.reference is not None:
            # a full frozen copy on each rank: no collectives, so the plain (unpadded) plan
            rows = list(range(len(batch))) if rows is None else rows
            return self.reference.logprobs(batch, lambda r: LocalWorker.plan(self, batch, r), rows=rows,
                                           dropout=dropout)
        out = super().logprobs(batch, which, rows=rows, dropout=dropout)
        if self._fsdp_units:            # FSDP2 keeps the root gathered after a forward without backward
            self.wrapped.reshard()
        return out

    # ------------------------------------------------------------------ the update
    def counts(self, n_tok: int, n_seq: int) -> tuple[int, int]:
        tok, seq = self.ctx.all_sum([float(n_tok), float(n_seq)])
        return int(tok), int(seq)

    def backward(self, loss: torch.Tensor) -> None:
        # the wrappers average over ranks; the shares must add. Not under gemm.grads_in_place (the
        # local worker's): DDP and FSDP2 hook each weight's gradient accumulation
        (loss * self.ctx.world).backward()

    def _sync(self, on: bool):
        if self.ctx.mode == "ddp":
            return contextlib.nullcontext() if on else self.wrapped.no_sync()
        self.wrapped.set_requires_gradient_sync(on)
        return contextlib.nullcontext()

    def _empty_step(self) -> None:
        logp, _ = self.forward(_empty_micro_batch(self.pad_id), want_entropy=False)
        self.backward(logp.sum() * 0.0)

    def accumulate(self, mbs: list[MicroBatch], step_one) -> list:
        """Every rank runs all its (padded) micro-batches; gradients are synchronised in the last
        backward pass; a non-finite micro-batch on any rank skips the mini-batch on all."""
        out, cause = [], None
        for i, mb in enumerate(mbs):
            with self._sync(i == len(mbs) - 1):
                if _is_empty(mb) or cause is not None:
                    self._empty_step()
                    continue
                try:
                    out.append(step_one(mb))
                except NonFiniteStep as exc:
                    cause = str(exc)
                    self._empty_step()
        if self.ctx.any(cause is not None):
            raise NonFiniteStep(cause or "a micro-batch of another rank was not finite")
        return out

    def train_step(self, batch, beta: float, *, step: int = 0) -> dict:
        out = super().train_step(batch, beta, step=step)
        out["memory/train_state_mb"] = self.train_state_bytes() / 2**20
        causes = out.pop("guard/causes")
        # token-weighted means (entropy, KL, clip fractions) over the job's tokens, the per-completion
        # KL over its completions: from the ranks' sums, as one process computes them
        every = self.ctx.gather(self.last_sums)
        total = {k: sum(d.get(k, 0.0) for d in every) for k in dict.fromkeys(k for d in every for k in d)}
        exact = {k: v / max(total["tokens"], 1) for k, v in total.items() if k not in ("tokens", "seqs", "kl_sum")}
        if "kl/ref_seq" in out:
            exact["kl/ref_seq"] = total["kl_sum"] / max(total["seqs"], 1)
        out = self.ctx.reduce_metrics({**out, **exact}, agreed=set(exact))
        out["guard/causes"] = causes
        return out

    def train_state_bytes(self) -> int:
        """Bytes this rank holds for parameters, their gradients (one per trainable parameter, alive
        during the update) and the optimizer state: with FSDP2 about 1/world of one process's."""
        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t
        params = [local(p) for p in self.model.parameters()]
        n = sum(t.numel() * t.element_size() for t in params)
        n += sum(local(p).numel() * local(p).element_size() for p in self.model.parameters() if p.requires_grad)
        for st in self.optimizer.state.values():
            n += sum(local(v).numel() * local(v).element_size() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
        return n

    # ------------------------------------------------------------------ weights and state
    def gathered(self):
        """All parameters gathered on every rank within (generation; FSDP2 only, DDP holds them)."""
        return gathered(self._fsdp_units)

    @torch.no_grad()
    def export_weights(self):
        """Full tensors (FSDP2 shards all-gathered, out of place; LoRA merged), named as the Hugging
        Face model names them. Every rank must iterate to the end (the gathers are collective)."""
        if is_peft(self.model):
            with self.gathered():
                full = {k: v.detach().clone() for k, v in merged_state_dict(self.model).items()}
            yield from full.items()
            return
        for name, t in self.model.state_dict().items():
            yield name, _full(t).detach()

    @torch.no_grad()
    def export_adapters(self):
        """The adapters alone (grpokit.models.lora.adapter_update), gathered; collective under FSDP2."""
        if not is_peft(self.model):
            return None
        with self.gathered():
            return adapter_update(self.model)

    @torch.no_grad()
    def export_base(self):
        """A LoRA policy's base weights, gathered (collective under FSDP2: every rank iterates)."""
        with self.gathered():
            full = {k: v.detach().clone() for k, v in merged_state_dict(self.model, adapters=False).items()}
        yield from full.items()

    def save_weights(self, path, *, merged: bool = False) -> None:
        """Sharded checkpoints: every rank writes its shards of the weights and the optimizer state
        into `path` (DCP), rank 0 the model's config beside them. Otherwise: gather the full weights
        on every rank; rank 0 writes them (`path` None: gather only)."""
        if self.sharded_checkpoints:
            sharded.save(path, self.wrapped, self.optimizer, prefix=ROOT)
            if self.ctx.is_main:
                self.model.config.save_pretrained(path)
                if getattr(self.model, "generation_config", None) is not None:
                    self.model.generation_config.save_pretrained(path)
            return
        if is_peft(self.model):
            # gathered, the modules hold full tensors in FSDP's buffers: the adapters are saved from
            # copies. (state_dict() would register the shards again: named_parameters() it is.)
            with self.gathered():
                if path is not None and self.ctx.is_main:
                    state = {k: v.detach().clone() for k, v in self.model.named_parameters()}
                    save_policy(self.model, path, merged=merged, state_dict=state)
            return
        full = {n: t for n, t in self.export_weights()}
        if path is not None and self.ctx.is_main:
            self.model.save_pretrained(Path(path), state_dict=full)

    def load_weights(self, ckpt) -> None:
        """A checkpoint's weights (written by any world size) into this rank's shards; a sharded
        checkpoint's optimizer state too."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from safetensors.torch import load_file

        if sharded.is_sharded(ckpt):
            if is_peft(self.model):
                raise ValueError(f"{ckpt} is a sharded full-model checkpoint; this run trains LoRA adapters")
            if self.ctx.mode == "fsdp2":
                sharded.load(ckpt, self.wrapped, self.optimizer, prefix=ROOT)
            else:                              # DDP: every rank reads the whole of it
                sharded.load(ckpt, self.model, self.optimizer)
            return

        if is_peft(self.model):
            with self.gathered():
                ckpt_lib.load_weights(self.model, ckpt)
            return
        state = {}
        for f in sorted(Path(ckpt).glob("*.safetensors")):
            state.update(load_file(f))
        if not state:
            raise FileNotFoundError(f"{ckpt}: no safetensors weights")
        names = dict(self.model.named_parameters(remove_duplicate=False))
        for n in names:                        # a tied LM head is saved once, under the embedding
            if n not in state and getattr(self.model.config, "tie_word_embeddings", False):
                emb = self.model.get_input_embeddings().weight
                tied = [k for k, p in names.items() if p is emb and k in state]
                if tied:
                    state[n] = state[tied[0]]
        set_model_state_dict(self.wrapped, {ROOT + k: v for k, v in state.items()},
                             options=StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=True))

    def trainable_names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def state_dict(self) -> dict:
        """Optimizer state as full tensors keyed by parameter name (loads at any world size); with
        sharded checkpoints it is in the DCP folder instead (`save_weights`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if self.sharded_checkpoints:
            return {"optimizer": sharded.IN_DCP, "scheduler": self.scheduler.state_dict()}

        osd = get_optimizer_state_dict(self.wrapped, self.optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        strip = {"state": {k.removeprefix(ROOT): v for k, v in osd.get("state", {}).items()},
                 "param_groups": [{**g, "params": [p.removeprefix(ROOT) for p in g["params"]]}
                                  for g in osd.get("param_groups", [])]}
        return {"optimizer": strip, "scheduler": self.scheduler.state_dict()}

    def load_optimizer_state(self, state) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if state == sharded.IN_DCP:             # loaded with the weights (load_weights)
            return

        named = ckpt_lib.optimizer_state_by_name(state, self.trainable_names())
        osd = {"state": {ROOT + k: v for k, v in named["state"].items()},
               "param_groups": [{**g, "params": [ROOT + p for p in g["params"]]} for g in named["param_groups"]]}
        set_optimizer_state_dict(self.wrapped, self.optimizer, osd,     # rank 0's state is the one used
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t
