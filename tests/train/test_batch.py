"""The explicit batch: ids per completion, slicing by whole groups (what data-parallel ranks take)."""

import pytest
import torch

from grpokit.algo import advantages as adv_lib
from grpokit.rollout.base import RolloutBatch
from grpokit.train import batch as batch_lib


def _rollout(n_prompts: int, G: int, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    N = n_prompts * G
    lengths = torch.randint(1, 6, (N,), generator=g)
    T = int(lengths.max())
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = torch.randint(3, 20, (N, T), generator=g).masked_fill(mask == 0, 0)
    logp = (-torch.rand(N, T, generator=g)).masked_fill(mask == 0, 0.0)
    return RolloutBatch([[1, 2 + p] for p in range(n_prompts) for _ in range(G)], ids, mask, logp,
                        ["eos"] * N, [f"c{i}" for i in range(N)])


def _batch(n_prompts=5, G=4, seed=0, **kw):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(n_prompts)]
    b = batch_lib.from_rollout(_rollout(n_prompts, G, seed), [10 + i for i in range(n_prompts)], rows, G, **kw)
    b.rewards = torch.rand(len(b), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return b


def test_from_rollout_labels_every_completion():
    b = _batch(3, 4, step=7)
    assert b.group_id.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert b.prompt_index.tolist() == [10] * 4 + [11] * 4 + [12] * 4
    assert len(set(b.uid)) == 12 and b.uid[5] == "7-1-1"
    assert [r["answer"] for r in b.rows] == ["0"] * 4 + ["1"] * 4 + ["2"] * 4
    assert torch.equal(b.loss_mask, b.mask) and b.loss_mask is not b.mask
    with pytest.raises(ValueError, match="12 completions for 2 prompts"):
        batch_lib.from_rollout(_rollout(3, 4), [0, 1], [{}, {}], 4)


def test_slice_groups_takes_whole_groups_with_every_field():
    b = _batch(5, 4)
    b.ref_logp = b.sampler_logp * 2
    b.advantages = torch.arange(20, dtype=torch.float32)
    s = batch_lib.slice_groups(b, [3, 1])
    rows = list(range(4, 8)) + list(range(12, 16))          # the batch's row order, not the argument's
    assert s.group_id.tolist() == [1] * 4 + [3] * 4
    assert s.uid == [b.uid[i] for i in rows] and s.completions == [b.completions[i] for i in rows]
    assert torch.equal(s.advantages, b.advantages[rows]) and torch.equal(s.rewards, b.rewards[rows])
    T = s.mask.shape[1]
    assert T == int(b.mask[rows].sum(-1).max())                 # trimmed to its own longest completion
    for name in ("completion_ids", "mask", "sampler_logp", "ref_logp", "loss_mask"):
        assert torch.equal(getattr(s, name), getattr(b, name)[rows, :T]), name
    batch_lib.check(s)
    with pytest.raises(ValueError, match="no group"):
        batch_lib.slice_groups(b, [9])


@pytest.mark.parametrize("world", [1, 2, 3, 5, 7])
def test_shards_partition_the_groups_and_keep_group_statistics(world):
    b = _batch(6, 4, seed=world)
    shards = [batch_lib.shard_groups(b, r, world) for r in range(world)]
    uids = [u for s in shards for u in s.uid]
    assert sorted(uids) == sorted(b.uid) and len(uids) == len(set(uids))   # a partition of the rows
    for s in shards:
        for g in s.groups:                                      # a group never spans ranks
            assert sum(1 for x in shards for gg in x.group_id.tolist() if gg == g) == 4
    # group-relative advantages computed on each shard equal those of the whole batch
    whole = dict(zip(b.uid, adv_lib.compute("grpo", b.rewards, group_ids=b.group_id).tolist()))
    for s in shards:
        if len(s):
            part = adv_lib.compute("grpo", s.rewards, group_ids=s.group_id)
            assert part.tolist() == pytest.approx([whole[u] for u in s.uid], abs=1e-12)


def test_concat_pads_and_keeps_ids():
    a, b = _batch(2, 3, seed=1), _batch(3, 3, seed=2, first_group=2)
    c = batch_lib.concat([a, b], pad_id=0)
    assert len(c) == 15 and c.group_id.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    T = c.mask.shape[1]
    assert T == max(a.mask.shape[1], b.mask.shape[1])
    assert torch.equal(c.mask[:6, :a.mask.shape[1]], a.mask) and c.mask[:6, a.mask.shape[1]:].sum() == 0
    assert c.old_logp is None                                   # a field missing in a part stays unset
    batch_lib.check(c)
