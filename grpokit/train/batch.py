"""The explicit batch every stage of a step reads and writes.

B completions, grouped: each row carries a uid, the dataset index of its prompt and its group id,
so nothing derives a group from a row's position. Log-probs (sampler, old, reference) are padded
tensors [B, T] sharing one completion mask (`mask`: every token after the prompt); `action_mask`
marks the tokens the policy sampled (all of them single-turn; a multi-turn episode's observations
are 0), and `loss_mask`, the mask the loss and the KL use, starts as it (transforms may zero rows of
it). A batch is cut by whole groups (`slice_groups`), which is what data-parallel
ranks take: group statistics then stay within one rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from grpokit.rollout.base import RolloutBatch


@dataclass
class Batch:
    uid: list[str]                        # [B] unique in the run: "<step>-<group>-<sample>"
    prompt_index: torch.Tensor            # [B] long: dataset index of the row's prompt
    group_id: torch.Tensor                # [B] long: equal within a group, 0..n_groups-1
    rows: list[dict]                      # [B] the dataset row of each completion's prompt
    prompt_ids: list[list[int]]           # [B] prompt token ids (unpadded)
    completion_ids: torch.Tensor          # [B, T] right-padded with pad_id
    mask: torch.Tensor                    # [B, T] long: 1 on generated tokens (EOS included)
    sampler_logp: torch.Tensor            # [B, T] log-probs of the distribution sampled from
    finish_reason: list[str]              # [B] "eos" | "length"
    completions: list[str]                # [B] decoded text
    resampled: int = 0                    # over-confidence resampling events in the rollout
    rewards: torch.Tensor | None = None   # [B] float64 weighted reward, NaN = not scored
    scores: dict[str, list] = field(default_factory=dict)   # reward function -> [B] scores (None = failed)
    reward_metrics: dict[str, float] = field(default_factory=dict)
    loss_mask: torch.Tensor | None = None  # [B, T] the mask the loss uses (defaults to `mask`)
    advantages: torch.Tensor | None = None  # [B]
    frac_zero_std: float | None = None     # share of groups whose rewards are all equal
    old_logp: torch.Tensor | None = None   # [B, T] pi_old (None: the current policy, detached)
    ref_logp: torch.Tensor | None = None   # [B, T] reference log-probs
    is_weights: torch.Tensor | None = None  # [B, T] sampler/trainer importance weights
    rewrites: tuple[list[list[int]], list[list[int]]] | None = None   # (contexts, note targets)
    action_mask: torch.Tensor | None = None  # [B, T] 1 on sampled tokens (defaults to `mask`)
    episodes: list[dict] | None = None     # [B] multi-turn episode records (None: single-turn)
    episode_of: torch.Tensor | None = None  # [B] long: step-wise segments, the episode each row is a turn of

    def __post_init__(self):
        if self.action_mask is None:
            self.action_mask = self.mask.clone()
        if self.loss_mask is None:
            self.loss_mask = self.action_mask.clone()

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def lengths(self) -> torch.Tensor:    # [B] tokens the policy sampled (a response's length)
        return self.action_mask.sum(-1)

    @property
    def groups(self) -> list[int]:
        """The distinct group ids, in order of first appearance."""
        return list(dict.fromkeys(self.group_id.tolist()))

    def group_rows(self) -> list[list[int]]:
        """Row indices of each group, in `groups` order."""
        at: dict[int, list[int]] = {}
        for i, g in enumerate(self.group_id.tolist()):
            at.setdefault(g, []).append(i)
        return list(at.values())


def from_rollout(rb: RolloutBatch, prompt_index: list[int], rows: list[dict], group_size: int, *,
                 step: int = 0, first_group: int = 0) -> Batch:
    """Label an engine's output (G samples of each prompt, group after group) with uids, prompt
    indices and group ids. `first_group` numbers this batch's groups after earlier ones."""
    G, n = group_size, len(prompt_index)
    if len(rb) != n * G:
        raise ValueError(f"the engine returned {len(rb)} completions for {n} prompts x {G} samples")
    gid = [first_group + g for g in range(n) for _ in range(G)]
    return Batch(
        uid=[f"{step}-{g}-{k}" for g in range(first_group, first_group + n) for k in range(G)],
        prompt_index=torch.tensor([i for i in prompt_index for _ in range(G)], dtype=torch.long),
        group_id=torch.tensor(gid, dtype=torch.long),
        rows=[r for r in rows for _ in range(G)],
        prompt_ids=list(rb.prompt_ids), completion_ids=rb.completion_ids, mask=rb.completion_mask,
        sampler_logp=rb.sampler_logprobs, finish_reason=list(rb.finish_reason),
        completions=list(rb.completions), resampled=rb.resampled, action_mask=rb.action_mask,
        episodes=list(rb.episodes) if rb.episodes is not None else None)


_PER_ROW_TENSORS = ("prompt_index", "group_id", "rewards", "advantages", "episode_of")
_PER_TOKEN_TENSORS = ("completion_ids", "mask", "sampler_logp", "loss_mask", "old_logp", "ref_logp", "is_weights",
                      "action_mask")
_PER_ROW_LISTS = ("uid", "rows", "prompt_ids", "finish_reason", "completions")
_OPTIONAL_ROW_LISTS = ("episodes",)


def to_segments(batch: Batch, pad_id: int, decode=None) -> Batch:
    """A batch of multi-turn episodes whose records hold `segments` (step-wise turns,
    grpokit.rollout.episodes.runner; a user loop's trajectories, grpokit.rollout.episodes.custom)
    as one row per segment. A segment is (prompt ids, ids, log-probs[, mask]) (no mask: every token
    sampled); its sampled tokens are the episode row's next action tokens, in order, and take the
    per-token values transforms set there (loss mask, and any log-probs already computed); its
    other tokens keep mask 0. Row-level fields (rewards, scores, group, advantages) are the
    episode's; `episode_of` says which episode each row belongs to; the last segment keeps the
    episode's finish reason. Batches without segments are returned as they are."""
    if batch.episodes is None or not any(r.get("segments") for r in batch.episodes):
        return batch
    plan = []                             # per new row: (episode row, turn, prompt, ids, logp, mask, positions)
    for i, rec in enumerate(batch.episodes):
        pos = batch.action_mask[i].nonzero().flatten().tolist()
        segs = rec.get("segments") or [(batch.prompt_ids[i], *_row_segment(batch, i))]
        at = 0
        for k, seg in enumerate(segs):
            prompt, ids, logp = seg[0], list(seg[1]), list(seg[2])
            m = list(seg[3]) if len(seg) > 3 else [1] * len(ids)
            span = pos[at:at + sum(m)]
            if batch.completion_ids[i, span].tolist() != [t for t, x in zip(ids, m) if x]:
                raise ValueError(f"episode {batch.uid[i]}: segment {k}'s sampled tokens are not the episode's")
            plan.append((i, k, prompt, ids, logp, m, span))
            at += len(span)
    R, T = len(plan), max(max((len(p[3]) for p in plan), default=1), 1)
    src = [p[0] for p in plan]
    out = {}
    for f in _PER_ROW_TENSORS:
        v = getattr(batch, f)
        out[f] = None if v is None else v[torch.tensor(src, dtype=torch.long)]
    out["episode_of"] = torch.tensor(src, dtype=torch.long)
    out["completion_ids"] = torch.full((R, T), pad_id, dtype=batch.completion_ids.dtype)
    out["mask"] = torch.zeros((R, T), dtype=batch.mask.dtype)
    out["action_mask"] = torch.zeros((R, T), dtype=batch.mask.dtype)
    out["sampler_logp"] = torch.zeros((R, T), dtype=batch.sampler_logp.dtype)
    for f in ("loss_mask", "old_logp", "ref_logp", "is_weights"):
        v = getattr(batch, f)
        out[f] = None if v is None else torch.zeros((R, T), dtype=v.dtype)
    for r, (i, _, _, ids, logp, m, span) in enumerate(plan):
        n = len(ids)
        out["completion_ids"][r, :n] = torch.tensor(ids, dtype=out["completion_ids"].dtype)
        out["mask"][r, :n] = 1
        trained = torch.tensor([j for j in range(n) if m[j]], dtype=torch.long)
        out["action_mask"][r, trained] = 1
        out["sampler_logp"][r, :n] = torch.tensor(logp, dtype=out["sampler_logp"].dtype)
        for f in ("loss_mask", "old_logp", "ref_logp", "is_weights"):
            if out[f] is not None:
                out[f][r, trained] = getattr(batch, f)[i, span]
    last = {i: r for r, i in enumerate(src)}
    out["uid"] = [f"{batch.uid[i]}/t{k}" for i, k, *_ in plan]
    out["rows"] = [batch.rows[i] for i in src]
    out["prompt_ids"] = [list(p[2]) for p in plan]
    out["finish_reason"] = [batch.finish_reason[i] if last[i] == r else "eos" for r, i in enumerate(src)]
    out["completions"] = [decode(p[3]) if decode else batch.completions[p[0]] for p in plan]
    out["episodes"] = [batch.episodes[i] for i in src]
    out["scores"] = {k: [v[i] for i in src] for k, v in batch.scores.items()}
    return replace(batch, **out)


def _row_segment(batch: Batch, i: int) -> tuple[list[int], list[float], list[int]]:
    """An episode row without segments as one segment: its ids, sampler log-probs and action mask."""
    n = int(batch.mask[i].sum())
    return (batch.completion_ids[i, :n].tolist(), batch.sampler_logp[i, :n].tolist(),
            batch.action_mask[i, :n].tolist())


def episodes_of(batch: Batch) -> tuple[list[int], torch.Tensor]:
    """(reps, expand): one row per episode (the last of its segments; every row when the batch has
    no segments) and, per row, its episode's position in `reps`. Episode-level statistics (one
    reward, one advantage, one length per episode) are taken at `reps` and broadcast by `expand`."""
    if batch.episode_of is None:
        return list(range(len(batch))), torch.arange(len(batch))
    order = list(dict.fromkeys(batch.episode_of.tolist()))
    pos = {e: k for k, e in enumerate(order)}
    last = {e: r for r, e in enumerate(batch.episode_of.tolist())}
    return [last[e] for e in order], torch.tensor([pos[e] for e in batch.episode_of.tolist()], dtype=torch.long)


def select(batch: Batch, rows: list[int]) -> Batch:
    """The sub-batch of `rows` (in that order), trimmed to its longest completion."""
    idx = torch.tensor(rows, dtype=torch.long)
    T = max(int(batch.mask[idx].sum(-1).max()), 1) if rows else 1
    out = {}
    for f in _PER_ROW_TENSORS:
        v = getattr(batch, f)
        out[f] = None if v is None else v[idx]
    for f in _PER_TOKEN_TENSORS:
        v = getattr(batch, f)
        out[f] = None if v is None else v[idx, :T]
    for f in _PER_ROW_LISTS:
        v = getattr(batch, f)
        out[f] = [v[r] for r in rows]
    for f in _OPTIONAL_ROW_LISTS:
        v = getattr(batch, f)
        out[f] = None if v is None else [v[r] for r in rows]
    out["scores"] = {k: [v[r] for r in rows] for k, v in batch.scores.items()}
    out["rewrites"] = None                 # rewriting is per step, not per slice
    return replace(batch, **out)


def slice_groups(batch: Batch, groups: list[int]) -> Batch:
    """The rows of the given group ids, whole groups only, in the batch's row order."""
    want = set(groups)
    unknown = want - set(batch.group_id.tolist())
    if unknown:
        raise ValueError(f"no group {sorted(unknown)[:3]} in this batch")
    return select(batch, [i for i, g in enumerate(batch.group_id.tolist()) if g in want])


def shard_groups(batch: Batch, rank: int, world: int) -> Batch:
    """Rank `rank`'s share of the batch's groups (round-robin by group order): whole groups only,
    so a group never spans ranks."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} not in [0, {world})")
    return slice_groups(batch, batch.groups[rank::world])


def concat(batches: list[Batch], pad_id: int) -> Batch:
    """Stack batches row-wise, right-padding per-token tensors to the longest."""
    if not batches:
        raise ValueError("nothing to concatenate")
    T = max(b.completion_ids.shape[1] for b in batches)

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, T - t.shape[1]), value=value)

    out = {}
    for f in _PER_ROW_TENSORS:
        vs = [getattr(b, f) for b in batches]
        out[f] = None if any(v is None for v in vs) else torch.cat(vs)
    for f in _PER_TOKEN_TENSORS:
        vs = [getattr(b, f) for b in batches]
        out[f] = None if any(v is None for v in vs) else torch.cat(
            [pad(v, pad_id if f == "completion_ids" else 0) for v in vs])
    for f in _PER_ROW_LISTS:
        out[f] = [x for b in batches for x in getattr(b, f)]
    for f in _OPTIONAL_ROW_LISTS:
        vs = [getattr(b, f) for b in batches]
        out[f] = None if any(v is None for v in vs) else [x for v in vs for x in v]
    out["scores"] = {k: [x for b in batches for x in b.scores[k]] for k in batches[0].scores}
    out["resampled"] = sum(b.resampled for b in batches)
    out["rewrites"] = None
    return replace(batches[0], **out)


def check(batch: Batch) -> None:
    """Raise if the batch's fields disagree in size (a transform or engine bug)."""
    B = len(batch)
    for f in fields(batch):
        v = getattr(batch, f.name)
        if f.name in _PER_ROW_LISTS or f.name in _PER_ROW_TENSORS or f.name in _OPTIONAL_ROW_LISTS:
            if v is not None and len(v) != B:
                raise ValueError(f"batch.{f.name} has {len(v)} rows, the batch {B}")
        elif f.name in _PER_TOKEN_TENSORS and v is not None and tuple(v.shape) != tuple(batch.mask.shape):
            raise ValueError(f"batch.{f.name} has shape {tuple(v.shape)}, the mask {tuple(batch.mask.shape)}")


def merged_reward_metrics(parts: list[Batch]) -> dict[str, float]:
    """The reward functions' metrics over the batches of a step's sampling rounds: error counts add
    up, the rest are averaged (NaN ignored; NaN when every part is NaN)."""
    out: dict[str, float] = {}
    for k in parts[0].reward_metrics:
        vals = [p.reward_metrics.get(k, float("nan")) for p in parts]
        finite = [v for v in vals if v == v]
        out[k] = float(sum(finite)) if k.endswith("/errors") else (sum(finite) / len(finite) if finite else float("nan"))
    return out
