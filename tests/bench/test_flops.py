"""The benchmark's FLOP count (bench/common.py) against a hand-worked example."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import common  # noqa: E402

# hidden 4, one layer, 2 query heads and 1 KV head of size 2, MLP 8, vocab 10.
#   matmul weights per layer: q 4x4 + k 4x2 + v 4x2 = 32, o 4x4 = 16, gate/up/down 3 x 4x8 = 96 -> 144
#   one token attending to c positions: 2*144 (matmuls) + 4*c*4 (QK^T and AV) = 288 + 16c,
#   plus the LM head 2*4*10 = 80 where its logits are needed.
DIMS = common.Dims(hidden=4, layers=1, heads=2, kv_heads=1, intermediate=8, vocab=10)


def test_layer_params():
    assert DIMS.layer_matmul_params == 144
    assert DIMS.token_forward(3, head=True) == 288 + 48 + 80


def test_one_sample():
    # prompt of 2 tokens, 3 completion tokens:
    #   generation: prefill of positions 0,1 (contexts 1,2; head on position 1 only)
    #                 2*288 + 16*(1+2) + 80 = 704
    #               decode of completion tokens 0,1 at positions 2,3 (the last token is never fed)
    #                 2*288 + 16*(3+4) + 2*80 = 848                             -> 1552
    #   reference:  positions 0..3 (contexts 1..4), head on positions 1,2,3 (predicting the completion)
    #                 4*288 + 16*10 + 3*80 = 1552
    #   policy:     forward + backward = 3 * 1552 = 4656
    f = common.step_flops(DIMS, [2], [3], group_size=1)
    assert f == {"generation": 1552, "reference": 1552, "policy": 4656, "total": 7760}


def test_prompt_prefill_counted_once_per_group():
    # two samples of one prompt (completions of 3 and 1 tokens): the prefill (704) once;
    # decode 848 for the first, nothing for the second (its only token comes from the prefill)
    f = common.step_flops(DIMS, [2, 2], [3, 1], group_size=2)
    assert f["generation"] == 704 + 848
    # reference: the prompt once for the group, as in generation (recomputing it per sample is not
    # useful work), then the same completion positions
    assert f["reference"] == f["generation"] and f["policy"] == 3 * f["reference"]
