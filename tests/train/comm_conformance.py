"""Checks every `Comm` must pass (grpokit.train.comm), at any world size: the single-process one
(identities, rank 0 of 1) and the torch.distributed one (tests/train/dist_programs.py `comm`, on 2
gloo ranks) run the same function. Each check states what the job as a whole must see, computed
from rank and world alone, so it can fail on a collective that drops, repeats or reorders ranks."""

from __future__ import annotations


def check_comm(comm) -> None:
    r, w = comm.rank, comm.world
    assert 0 <= r < w and comm.is_main == (r == 0)
    # collectives
    assert comm.gather({"rank": r}) == [{"rank": q} for q in range(w)]
    assert comm.all_sum([1.0, float(r)]) == [float(w), float(sum(range(w)))]
    assert comm.all_max(float(r)) == float(w - 1)
    assert comm.any(r == w - 1) is True and comm.any(False) is False
    assert comm.broadcast({"from": r, "seed": 7 + r}) == {"from": 0, "seed": 7}
    comm.barrier()
    # metrics: shares summed, extremes taken, the rest averaged, agreed keys and non-numbers kept
    got = comm.reduce_metrics({"loss/policy": 0.5, "time/step": float(r), "policy/logprob_min": -float(r),
                               "reward/mean": float(r), "kl/beta": 0.25, "guard/causes": ["x"]}, agreed={"kl/beta"})
    assert got == {"loss/policy": 0.5 * w, "time/step": float(w - 1), "policy/logprob_min": -float(w - 1),
                   "reward/mean": sum(range(w)) / w, "kl/beta": 0.25, "guard/causes": ["x"]}
    # whole groups per rank: the ranks' shares partition the step's prompts, in rank-strided order
    prompts = list(range(4 * w))
    mine = comm.my_prompts(prompts)
    every = comm.gather(mine)
    assert sorted(sum(every, [])) == prompts and every[r] == prompts[r::w]
    assert comm.gather(comm.first_group(4 * w, 4 * w)) == [4 * w + 4 * q for q in range(w)]
    shares = comm.gather(len(comm.my_prompts(list(range(2 * w + 1)))))      # a round that does not divide
    assert sum(shares) == 2 * w + 1 and comm.gather(comm.first_group(5, 2 * w + 1)) == [
        5 + sum(shares[:q]) for q in range(w)]
    # the dynamic-sampling quota: filled in rank order, the same total on every rank
    kept, total, found = comm.keep_groups(2, wanted=w + 1)
    assert total == min(2 * w, w + 1) and found == 2 * w
    assert sum(comm.gather(kept)) == total and kept == max(0, min(2, w + 1 - 2 * r))
    # per-group sampling seeds: the ranks' seeds together are the whole draw's, none repeated
    every = comm.gather(comm.group_seeds(3, 5, 0, 4 * w))
    assert len(set(sum(every, []))) == 4 * w and all(len(e) == 4 for e in every)
    streams = comm.group_streams(3, 5, 0, 4 * w)
    assert streams is None or streams == every[r]
