"""The training worker: everything that touches the policy's weights, behind a small Protocol.

The step (grpokit.train.step) asks a worker for log-probs of a batch, for one training step on
a batch, for its state, and for its weights to push to a rollout engine. `LocalWorker` is the
single-process implementation; a data-parallel worker implements the same Protocol and supplies
global token / sequence counts to the same per-micro-batch loss (`grpokit.algo.loss.grpo_loss`).

One `train_step` (DeepSeekMath, Shao et al. 2024, Algorithm 1, inner loop): μ passes over
`mini_batches` mini-batches; each mini-batch is cut into length-grouped micro-batches whose losses
sum exactly to the mini-batch loss (the whole mini-batch's counts are passed in), their gradients
accumulate, then one clipped AdamW step. Rows with advantage 0 skip the forward pass when they
cannot move the gradient (no KL term in the loss); they still count in the normaliser, so the
gradient is unchanged. A mini-batch whose loss or gradient is not finite is skipped alone and its
cause named (grpokit.train.guard): the others are applied.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Iterator, Protocol, runtime_checkable

import numpy as np
import torch

from grpokit import gemm
from grpokit.algo import loss as loss_lib
from grpokit.algo.control import decay
from grpokit.train import forward as lean_forward
from grpokit.train.batch import Batch
from grpokit.train.guard import NonFiniteStep, diagnose
from grpokit.train import checkpoint as ckpt_lib
from grpokit.models import sharded
from grpokit.models.lora import adapter_update, is_peft, merged_state_dict, save_policy
from grpokit.train.logprobs import (MicroBatch, build_micro_batch, completion_logprobs, padded_logprobs,
                                    padding_fraction, plan_micro_batches, unwrap)
from grpokit.train.reference import Reference


@runtime_checkable
class TrainingWorker(Protocol):
    """What the driver needs of a training backend (local, DDP, FSDP2, ...)."""

    def logprobs(self, batch: Batch, which: str = "policy") -> torch.Tensor:
        """[B, T] per-token log-probs of the batch's completions under "policy" or "reference"
        (no gradient; 0 past each row's end)."""

    def train_step(self, batch: Batch, beta: float) -> dict[str, float]:
        """One training step on a batch with advantages (and old / reference log-probs when the
        loss needs them). Returns metrics, with `guard/updates_skipped` and `guard/causes`."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full, Hugging Face-named tensors of the current policy (LoRA merged, out of place)."""

    def export_adapters(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict]] | None:
        """A LoRA policy's adapters as a rollout server folds them in (grpokit.models.lora.
        adapter_update), or None (not LoRA, or adapters that must go merged)."""

    def export_base(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A LoRA policy's base weights (dequantized), Hugging Face-named: what the adapters fold into."""

    def save_weights(self, path, *, merged: bool = False) -> None:
        """Write the policy into a checkpoint folder (`path` None: a rank that does not write)."""

    def load_weights(self, ckpt) -> None:
        """Load a checkpoint's policy weights in place."""

    def load_optimizer_state(self, state: dict) -> None:
        """Load an optimizer state (numbered, or keyed by parameter name from any world size)."""


def lr_lambda(warmup_steps: int, schedule: str, total: int):
    """Learning-rate factor per optimizer step: linear warm-up, then constant, cosine or linear decay."""
    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        return decay((step - warmup_steps) / max(1, total - warmup_steps), schedule)
    return f


_NOTHING_SEEN = (0.0, math.inf)   # (largest ratio, smallest log-prob) of a mini-batch, for the guard


def drop_padding_idx(model) -> None:
    """Make the policy's input embedding an ordinary lookup: grpokit masks padding with the attention
    mask, while `nn.Embedding(padding_idx=pad_id)` (transformers sets it from `pad_token_id`) zeroes
    the gradient of every lookup of the pad id, real occurrences included: a chat separator that is
    also the pad token (`<|im_end|>` in several chat models), or a pad id sampled mid-completion.
    grpokit's own forward (grpokit.train.forward) takes the true gradient; without this the model's
    forward (FSDP2, gradient checkpointing, architectures the lean forward does not cover) gave that
    row another one. Forward values do not change."""
    emb = unwrap(model).get_input_embeddings() if hasattr(unwrap(model), "get_input_embeddings") else None
    if isinstance(emb, torch.nn.Embedding) and emb.padding_idx is not None:
        emb.padding_idx = None


class AdamW(torch.optim.AdamW):
    """AdamW whose loaded state keeps this optimizer's implementation (fused or multi-tensor): a
    checkpoint carries the flags of the run that saved it, which may have had another layout."""

    def load_state_dict(self, state_dict: dict) -> None:
        groups = [{**g, "fused": mine.get("fused"), "foreach": mine.get("foreach")}
                  for g, mine in zip(state_dict["param_groups"], self.param_groups)]
        super().load_state_dict({**state_dict, "param_groups": groups})


def adamw(params: list, **kw) -> AdamW:
    """AdamW, PyTorch's fused kernel where every parameter is a plain CPU or CUDA tensor (one pass
    over the weights, gradients and both moments instead of a dozen: 0.09 against 0.45-0.58 s per
    step for SmolLM2-135M on 2 CPU cores); its multi-tensor form otherwise (sharded DTensors)."""
    plain = all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point
                for p in params)
    if plain:
        try:
            return AdamW(params, fused=True, **kw)
        except (RuntimeError, ValueError):
            pass
    return AdamW(params, **kw)


class LocalWorker:
    """The policy, its optimizer and schedule, and its reference, in this process."""

    def __init__(self, cfg, model, tokenizer, reference: Reference | None):
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        self.cfg, self.model, self.reference = cfg, model, reference
        self.pad_id = tokenizer.pad_token_id
        drop_padding_idx(model)
        self.device = next(model.parameters()).device
        o = cfg.optim
        self.optimizer = adamw(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        total = cfg.train.steps * cfg.algorithm.mu * cfg.algorithm.mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(o.warmup_steps, o.schedule, total))
        self._seen = _NOTHING_SEEN      # what the guard needs to name the cause of a bad gradient
        self._causes: list[str] = []
        self.entropy_coef = float(cfg.algorithm.entropy_coef)   # the bonus's coefficient now (adaptive control moves it)

    # ------------------------------------------------------------------ log-probs
    def plan(self, batch: Batch, rows: list[int]) -> list[MicroBatch]:
        """Micro-batches over `rows`, grouped by length (and prompt, for the lean forward)."""
        if not rows:
            return []
        totals = [len(batch.prompt_ids[i]) + int(batch.mask[i].sum()) for i in rows]
        lean = lean_forward.supports(unwrap(self.model))     # prompts run once per micro-batch
        plan = plan_micro_batches(totals, self.cfg.optim.micro_batch_size,
                                  [batch.prompt_ids[i] for i in rows] if lean else None)
        return [build_micro_batch([rows[j] for j in mb], batch.prompt_ids, batch.completion_ids,
                                  batch.mask, self.pad_id) for mb in plan]

    def logprobs(self, batch: Batch, which: str = "policy", *, rows: list[int] | None = None,
                 dropout: bool = True) -> torch.Tensor:
        rows = list(range(len(batch))) if rows is None else rows
        if which == "reference":
            if self.reference is None:
                raise ValueError("no reference model (algorithm.kl.beta = 0)")
            return self.reference.logprobs(batch, lambda r: self.plan(batch, r), rows=rows, dropout=dropout)
        if which != "policy":
            raise ValueError(f"which must be 'policy' or 'reference', got {which!r}")
        return padded_logprobs(self.model, self.plan(batch, rows), tuple(batch.mask.shape),
                               temperature=self.cfg.rollout.temperature, chunk_tokens=self.cfg.optim.logprob_chunk,
                               forward=self.forward)

    def forward(self, mb: MicroBatch, *, want_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's (log-probs, entropy) of a micro-batch's completions. A data-parallel worker
        runs it through its wrapped module, so that the wrapper's hooks (gradient sync, parameter
        gathering) see every forward pass."""
        return completion_logprobs(self.model, mb, temperature=self.cfg.rollout.temperature,
                                   chunk_tokens=self.cfg.optim.logprob_chunk, want_entropy=want_entropy)

    def counts(self, n_tok: int, n_seq: int) -> tuple[int, int]:
        """The loss normalisers of a mini-batch: its tokens and sequences (a data-parallel worker:
        summed over the ranks, so that every rank's loss is its share of the global loss)."""
        return n_tok, n_seq

    def accumulate(self, mbs: list[MicroBatch], step_one) -> list:
        """Forward and backward of a mini-batch's micro-batches (`step_one(mb)` each); raises
        NonFiniteStep at the first one that is not finite."""
        return [step_one(mb) for mb in mbs]

    # ------------------------------------------------------------------ the update
    def updates_per_step(self) -> int:
        return self.cfg.algorithm.mu * self.cfg.algorithm.mini_batches

    def train_step(self, batch: Batch, beta: float, *, step: int = 0) -> dict[str, float]:
        """μ passes over mini-batches. Losses are summed over the micro-batches of a mini-batch (they
        add up to the mini-batch loss) and averaged over mini-batches; per-token statistics are
        token-weighted. `step` seeds the mini-batch shuffle."""
        cfg, a = self.cfg, self.cfg.algorithm
        if batch.advantages is None:
            raise ValueError("train_step needs a batch with advantages")
        N = len(batch)
        kl_in_loss = beta > 0 and not a.kl.in_reward and batch.ref_logp is not None
        losses: dict[str, list[float]] = {}
        tok_sums: dict[str, float] = {}
        n_tok_seen, ratio_max, logp_min, grad_norms, pads = 0, float("nan"), math.inf, [], []
        kl_sum, n_seq_seen = 0.0, 0
        self._causes = []
        rng = np.random.default_rng([cfg.train.seed, step])
        for epoch in range(a.mu):
            perm = rng.permutation(N) if a.mini_batches > 1 else np.arange(N)
            for mini in np.array_split(perm, a.mini_batches):
                mini = mini.tolist()
                n_tok, n_seq = self.counts(int(batch.loss_mask[mini].sum()), len(mini))
                # rows that can move the gradient: non-zero advantage, or any row when KL (or an
                # entropy bonus) is in the loss; every row under adaptive entropy control, whose
                # entropy must be measured even when a collapsed policy's groups all agree
                every = kl_in_loss or bool(self.entropy_coef) or a.entropy_target is not None
                live = [i for i in mini if (every or float(batch.advantages[i]) != 0.0)
                        and bool(batch.loss_mask[i].any())]
                self.optimizer.zero_grad(set_to_none=True)
                mbs = self.plan(batch, live)     # on every rank, rows or none: a data-parallel plan is collective
                mini_loss: dict[str, float] = {}
                try:
                    micro = self.accumulate(mbs, lambda mb: self._micro_step(mb, batch, beta, kl_in_loss, n_tok, n_seq))
                except NonFiniteStep as exc:   # the guard: nothing of this mini-batch reaches the weights
                    self.optimizer.zero_grad(set_to_none=True)
                    self._advance_schedule()
                    self._causes.append(str(exc))
                    continue
                for st, ntok in micro:
                    for k in ("loss/policy", "loss/kl", "loss/total", "loss/token_mean", "loss/entropy_bonus"):
                        if k in st:
                            mini_loss[k] = mini_loss.get(k, 0.0) + st.pop(k)
                    r = st.pop("policy/ratio_max", float("nan"))
                    ratio_max = r if math.isnan(ratio_max) else max(ratio_max, r)
                    logp_min = min(logp_min, st.pop("policy/logprob_min", math.inf))
                    kl_sum += st.pop("kl/sum", 0.0)
                    n_seq_seen += int(st.pop("rows"))
                    for k, v in st.items():
                        tok_sums[k] = tok_sums.get(k, 0.0) + v * ntok
                    n_tok_seen += ntok
                if batch.rewrites and epoch == 0 and not losses.get("loss/rewrite"):
                    mini_loss["loss/rewrite"] = self._rewrite_step(batch.rewrites)
                for k, v in mini_loss.items():
                    losses.setdefault(k, []).append(v)
                grad_norms.append(self._optimizer_step(batch, has_grad=bool(mbs) or "loss/rewrite" in mini_loss))
                pads.append(padding_fraction(mbs) if mbs else 0.0)
        out = {k: float(np.mean(v)) for k, v in losses.items()}
        out.update({k: v / max(n_tok_seen, 1) for k, v in tok_sums.items()})
        # the sums behind the token- and sequence-weighted means (a data-parallel worker combines them)
        self.last_sums = {"tokens": float(n_tok_seen), "seqs": float(n_seq_seen), "kl_sum": kl_sum, **tok_sums}
        out["policy/ratio_max"] = ratio_max
        if "kl/ref" in out:                          # KL of a whole completion, averaged over completions
            out["kl/ref_seq"] = kl_sum / max(n_seq_seen, 1)
        if math.isfinite(logp_min):
            out["policy/logprob_min"] = logp_min
        finite_gn = [g for g in grad_norms if not math.isnan(g)]
        out["optim/grad_norm"] = float(np.mean(finite_gn)) if finite_gn else float("nan")
        out["update/padding_frac"] = float(np.mean(pads)) if pads else 0.0
        out["optim/lr"] = self.scheduler.get_last_lr()[0]
        out["guard/updates_skipped"] = float(len(self._causes))
        out["guard/causes"] = list(self._causes)
        return out

    def _diagnose(self, batch: Batch, **found) -> str:
        """The guard's cause, with the step's rewards and zero-std share (the first two checks)."""
        return diagnose(rewards=batch.rewards, frac_zero_std=batch.frac_zero_std, **found)

    def _micro_step(self, mb: MicroBatch, batch: Batch, beta: float, kl_in_loss: bool,
                    n_tok: int, n_seq: int) -> tuple[dict, int]:
        a = self.cfg.algorithm
        rows, dev = mb.rows, self.device
        coef = self.entropy_coef
        logp, ent = self.forward(mb, want_entropy="grad" if coef else True)
        L = logp.shape[1]
        mask = batch.loss_mask[rows, :L].to(dev).to(logp.dtype)
        valid = logp.detach()[mask.bool()]
        adv = batch.advantages[rows].to(dev, logp.dtype)
        if not torch.isfinite(valid).all():
            self._seen = _NOTHING_SEEN
            raise NonFiniteStep(self._diagnose(batch, advantages=adv, logp_finite=False,
                                               half_precision=self._float32_rescues(mb, mask)))

        def cut(t):
            return None if t is None else t[rows, :L].to(dev, logp.dtype)
        old = cut(batch.old_logp) if batch.old_logp is not None else logp.detach()
        total, st = loss_lib.grpo_loss(
            logp, old, adv, mask, ref_logp=cut(batch.ref_logp) if kl_in_loss else None,
            beta=beta if kl_in_loss else 0.0, kl_kind=a.kl.estimator, agg=a.loss_agg, num_tokens=n_tok,
            num_seqs=n_seq, max_len=self.cfg.rollout.max_new_tokens, eps_low=a.eps_low, eps_high=a.eps_high,
            dual_clip=a.dual_clip, ratio_level=a.ratio_level, is_weights=cut(batch.is_weights))
        if coef:                                # an entropy bonus, aggregated like the surrogate
            ent_term = loss_lib.aggregate(ent, mask.bool(), a.loss_agg, num_tokens=n_tok, num_seqs=n_seq,
                                          max_len=self.cfg.rollout.max_new_tokens)
            total = total - coef * ent_term
            st["entropy_bonus"] = float(ent_term.detach()) * coef
        ntok = int(mask.sum())
        lp_min = float(valid.min()) if valid.numel() else math.inf
        if not torch.isfinite(total.detach()):
            self._seen = _NOTHING_SEEN
            raise NonFiniteStep(self._diagnose(batch, advantages=adv, ratio_max=st.get("ratio_max"),
                                               logp_min=lp_min if valid.numel() else None,
                                               half_precision=self._float32_rescues(mb, mask)))
        self._seen = (max(self._seen[0], st.get("ratio_max", 0.0)), min(self._seen[1], lp_min))
        self.backward(total)
        out = {"loss/policy": st["policy"], "loss/total": float(total.detach()),
               # the token-level loss signal, whatever the aggregation: Σ surrogate / mini-batch tokens
               "loss/token_mean": st["policy"] if a.loss_agg == "token_mean" else st["token_sum"] / max(n_tok, 1),
               "policy/entropy": float(torch.where(mask.bool(), ent.detach(), 0.0).sum()) / max(ntok, 1),
               "policy/logprob_min": lp_min, "rows": float(mask.any(-1).sum())}
        if "entropy_bonus" in st:
            out["loss/entropy_bonus"] = st["entropy_bonus"]
        if "kl" in st:
            out["loss/kl"] = st["kl"]
            out["kl/ref"] = st["kl_sum"] / max(ntok, 1)
            out["kl/sum"] = st["kl_sum"]
        for k in ("clip_frac_low", "clip_frac_high", "approx_kl", "ratio_max"):
            out[f"policy/{'approx_kl_old' if k == 'approx_kl' else k}"] = float(st[k])
        return out, ntok

    def backward(self, loss: torch.Tensor) -> None:
        # micro-batches after the first: GEMMs add into .grad. Not for a wrapped model (DDP, FSDP2):
        # their hooks on the gradients' accumulation would not run (DataParallelWorker overrides this)
        with gemm.grads_in_place():
            loss.backward()

    @torch.no_grad()
    def _float32_rescues(self, mb: MicroBatch, mask: torch.Tensor) -> str | None:
        """For a policy in bfloat16 / float16 whose forward pass was not finite: the dtype's name when
        the same micro-batch through a float32 copy of the policy gives finite log-probs (the
        overflow is the precision's, not the weights'), else None. A copy is made only here, on
        a failed step."""
        dtype = next(self.model.parameters()).dtype
        if dtype not in (torch.bfloat16, torch.float16):
            return None
        full = copy.deepcopy(self.model).float()
        logp, _ = completion_logprobs(full, mb, temperature=self.cfg.rollout.temperature,
                                      chunk_tokens=self.cfg.optim.logprob_chunk)
        del full
        ok = bool(torch.isfinite(logp[mask.bool()]).all())
        return str(dtype).removeprefix("torch.") if ok else None

    def _rewrite_step(self, rewrites) -> float:
        """Wrong-answer rewriting's auxiliary term (grpokit.data.rewrite), added to the first
        optimizer step of the update: weight * token-mean NLL of the notes, under the policy as the
        surrogate sees it (the sampling temperature). Through `forward`, `counts` and `accumulate`, so
        a data-parallel job normalises by the notes' tokens over all ranks and every rank runs the
        same passes (a rank without notes runs empty ones)."""
        contexts, targets = rewrites
        n_tok = self.counts(sum(len(t) for t in targets), 0)[0]
        if n_tok == 0:
            return 0.0
        mbs = []
        if contexts:
            L = max(len(t) for t in targets)
            ids = torch.full((len(targets), L), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(targets), L), dtype=torch.long)
            for i, t in enumerate(targets):
                ids[i, :len(t)], mask[i, :len(t)] = torch.tensor(t), 1
            mbs = [build_micro_batch(chunk, contexts, ids, mask, self.pad_id)
                   for chunk in plan_micro_batches([len(c) + len(t) for c, t in zip(contexts, targets)],
                                                   self.cfg.optim.micro_batch_size)]
        weight = self.cfg.algorithm.rewrite.weight

        def one(mb: MicroBatch) -> float:
            logp, _ = self.forward(mb)
            loss = -weight * torch.where(mb.mask.to(logp.device).bool(), logp, 0.0).sum() / n_tok
            if not torch.isfinite(loss) and not self.joins_every_pass:
                return 0.0               # one process: skip it (the policy update stands)
            self.backward(loss)          # several: every rank must; a NaN gradient makes the guard skip the update
            return float(loss.detach())

        return float(sum(self.accumulate(self.pad_plan(mbs), one)))

    joins_every_pass = False
    """True for a worker whose passes are collective (data parallel): each rank runs every pass."""

    def pad_plan(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        """The micro-batches every rank runs (one process: these)."""
        return mbs

    def _advance_schedule(self) -> None:
        """A skipped update still advances the learning-rate schedule (it counts training steps),
        so torch's 'scheduler before optimizer' warning does not apply."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()

    def skip_step(self) -> None:
        """A step with no update at all (its rollout failed): the schedule still advances."""
        for _ in range(self.updates_per_step()):
            self._advance_schedule()

    def _optimizer_step(self, batch: Batch, has_grad: bool) -> float:
        """Clip and apply the accumulated gradient; NaN (and nothing applied) when it is not finite."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if not has_grad:
            self._advance_schedule()
            return 0.0
        gn = torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.max_grad_norm)
        ratio_max, logp_min = self._seen
        self._seen = _NOTHING_SEEN
        if not torch.isfinite(gn):
            # this update never reaches the weights; the cause is named in the diagnosis order (a
            # ratio overflow or extreme log-probs before the gradient itself)
            self.optimizer.zero_grad(set_to_none=True)
            self._advance_schedule()
            self._causes.append(self._diagnose(batch, ratio_max=ratio_max, logp_min=logp_min, grad_finite=False))
            return float("nan")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)   # gradients are not held through the next rollout
        self.scheduler.step()
        return float(gn)

    # ------------------------------------------------------------------ state and weights
    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.load_optimizer_state(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def trainable_names(self) -> list[str]:
        """Names of the optimizer's parameters, in its order."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def load_optimizer_state(self, state) -> None:
        """The optimizer's state, also from a data-parallel run's checkpoint (keyed by parameter
        name; grpokit.train.checkpoint.optimizer_state_by_index). A sharded checkpoint's is loaded
        with its weights (`load_weights`)."""
        if state == sharded.IN_DCP:
            return
        self.optimizer.load_state_dict(ckpt_lib.optimizer_state_by_index(state, self.trainable_names()))

    def save_weights(self, path, *, merged: bool = False) -> None:
        """The policy as a Hugging Face directory (a LoRA policy: its adapters, or merged)."""
        save_policy(self.model, path, merged=merged)

    def load_weights(self, ckpt) -> None:
        """Load a checkpoint's policy weights in place; from a sharded checkpoint (an FSDP2 run's,
        any world size) the optimizer state too."""
        if sharded.is_sharded(ckpt):
            if is_peft(self.model):
                raise ValueError(f"{ckpt} is a sharded full-model checkpoint; this run trains LoRA adapters")
            sharded.load(ckpt, self.model, self.optimizer)
            return
        ckpt_lib.load_weights(self.model, ckpt)

    def scale_lr(self, factor: float) -> None:
        """Multiply the learning rate (base and current) by `factor` (after a rollback)."""
        self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)

    @torch.no_grad()
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if is_peft(self.model):
            yield from merged_state_dict(self.model).items()   # out of place: the adapters stay
            return
        for name, t in self.model.state_dict().items():
            yield name, t.detach()

    def export_adapters(self):
        return adapter_update(self.model) if is_peft(self.model) else None

    def export_base(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from merged_state_dict(self.model, adapters=False).items()
