"""Weight sync to a rollout server, per step: the full (merged) weights vs a LoRA run's adapters alone
(docs/rollout.md, "How weights are synced").

Two `grpokit rollout-server` processes over SmolLM2-135M-Instruct (or `--model DIR`); the trainer
side is a LoRA policy (rank `--rank`, the default target modules) in this process. Each round pushes
the merged model to the first server (`update_weights`, what a full-weight run or
`rollout.sync_adapters=false` sends) and the adapters alone to the second (`update_adapters`, after
the base once), so that both see the same machine load; after each, the server's checksums are
compared with the trainer's merged weights. Export time (merging, copying) is included in both. Reported: MiB and seconds per sync (median over rounds, the first round of each left out)
and their ratios, from one run.

    python bench/sync.py [--model DIR] [--rounds 8] [--rank 16] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import start_rollout_server  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a local Hugging Face model directory (default: SmolLM2-135M)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    from grpokit.config import LoraSection
    from grpokit.models import load_model, load_tokenizer
    from grpokit.models.lora import adapter_update, merged_state_dict, wrap_lora
    from grpokit.rollout.client import ServerEngine
    from grpokit.rollout.server import tensor_checksum

    if args.model:
        model_dir = Path(args.model)
    else:
        from bench import smollm2
        if (why := smollm2.missing()):
            print(f"skipped: {why}")
            return 0
        model_dir = smollm2.convert()
    torch.manual_seed(0)
    policy = wrap_lora(load_model(model_dir, dtype="float32", device="cpu"), LoraSection(enabled=True, rank=args.rank))
    tok = load_tokenizer(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        procs = [start_rollout_server(model_dir, Path(tmp) / f"server{i}.log", threads=1) for i in (0, 1)]
        try:
            to_full, engine = (ServerEngine(a, tok, timeout_s=600, bucket_mb=args.bucket_mb) for _, a in procs)
            if not engine.takes_adapters:
                raise SystemExit("this server does not take adapters")
            rows = {"full": [], "adapters": []}
            version = 0

            def check(client) -> None:
                want = {n: tensor_checksum(t) for n, t in merged_state_dict(policy).items()}
                got = client.checksums()
                if {n: got[n] for n in want} != want:
                    raise SystemExit("the server's weights differ from the trainer's merged weights")

            for r in range(args.rounds + 1):
                with torch.no_grad():                    # a step's worth of change in the adapters
                    for n, p in policy.named_parameters():
                        if "lora_" in n:
                            p.add_(1e-3 * torch.randn_like(p))
                version += 1
                t = time.perf_counter()
                to_full.update_weights(merged_state_dict(policy).items(), version=version)
                full = {"s": time.perf_counter() - t, "mb": to_full.last_sync["sync/mb"], "export_s": None}
                check(to_full)
                need = engine.needs_base()
                t = time.perf_counter()
                ad = adapter_update(policy)
                export_s = time.perf_counter() - t
                base = iter(merged_state_dict(policy, adapters=False).items()) if need else None
                engine.update_adapters(*ad, base=base, version=version)
                small = {"s": time.perf_counter() - t, "mb": engine.last_sync["sync/mb"], "export_s": export_s}
                check(engine)
                if r:                                    # round 0: warm-up (and the adapters' base)
                    rows["full"].append(full)
                    rows["adapters"].append(small)
                print(f"round {r}: full {full['mb']:.1f} MiB {full['s']:.3f} s | adapters {small['mb']:.2f} MiB "
                      f"{small['s']:.3f} s{' (with the base)' if need else ''}", flush=True)
            engine.close()
            to_full.close()
        finally:
            for proc, _ in procs:
                proc.kill()
                proc.wait(timeout=30)
    med = {k: {"s": statistics.median(x["s"] for x in v), "mb": statistics.median(x["mb"] for x in v)}
           for k, v in rows.items()}
    res = {"model": str(model_dir), "rank": args.rank, "rounds": args.rounds, "threads": torch.get_num_threads(),
           "cpus": os.cpu_count(), "load_at_start": os.getloadavg()[0], "median": med,
           "ratio_s": med["full"]["s"] / med["adapters"]["s"], "ratio_mb": med["full"]["mb"] / med["adapters"]["mb"],
           "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"full weights: {med['full']['mb']:.1f} MiB, {med['full']['s']:.3f} s per sync; LoRA r={args.rank} "
          f"adapters: {med['adapters']['mb']:.2f} MiB, {med['adapters']['s']:.3f} s per sync; "
          f"{res['ratio_mb']:.0f}x fewer bytes, {res['ratio_s']:.1f}x faster ({args.rounds} rounds, median)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
