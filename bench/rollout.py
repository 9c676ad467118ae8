"""Rollout throughput: grpokit's HF engine against the in-process vLLM engine, same prompts, same model.

    .venv-vllm/bin/python bench/rollout.py [--model DIR | --size small|qwen05b] [--prompts 16]
        [--n 8] [--max-new-tokens 64] [--rounds 3] [--dtype float32] [--out results.json]
    make bench-rollout BENCH_ARGS="--size small"

What it does:
  1. takes a local Hugging Face model directory (`--model`), or builds one offline and seeded
     with grpokit's character tokenizer (`--size small`: Qwen2, hidden 256 x 4 layers, head size
     64; `--size qwen05b`: the layer shapes of Qwen2.5-0.5B, hidden 896 x 24 layers, 14 query and
     2 key/value heads, MLP 4864, with a character vocabulary: about 0.36 B parameters, the
     non-embedding size of Qwen2.5-0.5B);
  2. encodes the same arithmetic prompts for both engines and samples G completions each at
     temperature 1 with `ignore_eos`, so both engines produce exactly the same number of tokens;
  3. starts both engines in this process (vLLM's start-up is timed on its own), runs one warm-up
     round each, then `--rounds` rounds alternating HF, vLLM, HF, vLLM ... so that drift on a
     shared machine falls on both;
  4. prints generated tokens/s of each (median over rounds) and the ratio vLLM / HF, and writes
     them with the settings and versions to `--out` (JSON).

Both engines use the same torch thread count: OMP_NUM_THREADS (default: every CPU), set before
torch is imported, because vLLM's CPU backend otherwise drops torch to one thread in its process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = {  # build_tiny_model arguments
    "small": dict(hidden=256, layers=4, heads=4, intermediate=1024),
    "qwen05b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a local Hugging Face causal-LM directory")
    src.add_argument("--size", choices=sorted(SIZES), default="small", help="a model built here (default: small)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--kv-cache-mb", type=int, default=512, help="vLLM's KV cache (MiB)")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs / torch.compile")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both engines (0: OMP_NUM_THREADS or every CPU)")
    ap.add_argument("--out", default="", help="write the result here (JSON)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(threads)          # before torch: vLLM keeps it (see docstring)
    import torch

    from grpokit.rollout.base import SamplingParams
    from grpokit.rollout.hf import HFEngine
    from grpokit.rollout.vllm import VLLMEngine, import_vllm
    from grpokit.tasks.arithmetic import ArithmeticTask
    from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model, save_pretrained
    from grpokit.models.hf import load_model, load_tokenizer

    vllm = import_vllm()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    tmp = tempfile.TemporaryDirectory(prefix="grpokit-bench-rollout-")
    if args.model:
        model_dir, what = Path(args.model), args.model
    else:
        tok = build_char_tokenizer()
        model = build_tiny_model(tok, arch="qwen2", max_positions=1024, seed=0, **SIZES[args.size])
        model_dir, what = save_pretrained(model, tok, Path(tmp.name) / args.size), f"built: {args.size}"
        del model
    tok = load_tokenizer(str(model_dir))
    model = load_model(str(model_dir), dtype=dtype, device=device)
    n_params = sum(p.numel() for p in model.parameters())

    rows = ArithmeticTask(seed=0, heldout=0).train_rows(args.prompts, 0)
    prompts = [tok.encode(r["prompt"]) for r in rows]
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, ignore_eos=True)

    hf = HFEngine(model, tok)
    t = time.perf_counter()
    vl = VLLMEngine(str(model_dir), tok, dtype=dtype, kv_cache_memory_bytes=args.kv_cache_mb << 20,
                    enforce_eager=args.enforce_eager, max_model_len=max(map(len, prompts)) + args.max_new_tokens)
    startup = time.perf_counter() - t
    torch.set_num_threads(threads)       # a no-op once vLLM's CPU backend has bound its threads
    engines = {"hf": hf, "vllm": vl}
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(args.rounds + 1):
        for name, engine in engines.items():
            gen = torch.Generator().manual_seed(r)
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = engine.generate(prompts, params, gen)
            if device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            tokens = int(out.completion_mask.sum())
            assert tokens == len(prompts) * args.n * args.max_new_tokens, (name, tokens)
            if r:                                          # round 0 warms up
                rates[name].append(tokens / dt)
            print(f"round {r} {name:5s} {tokens} tokens in {dt:.2f} s = {tokens / dt:.0f} tokens/s"
                  f"{'  (warm-up)' if not r else ''}", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "model": what, "parameters": n_params, "device": device, "dtype": dtype, "prompts": len(prompts),
        "n": args.n, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "threads": threads,
        "torch_threads_after_vllm_start": torch.get_num_threads(),
        "tokens_per_s": med, "tokens_per_s_all": rates, "ratio_vllm_over_hf": med["vllm"] / med["hf"],
        "vllm_startup_s": startup, "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "machine": {"cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0], "platform": platform.platform()},
    }
    print(f"HF engine {med['hf']:.0f} tokens/s, vLLM {med['vllm']:.0f} tokens/s: "
          f"vLLM / HF = {result['ratio_vllm_over_hf']:.2f} (vLLM start-up {startup:.1f} s)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    vl.close()
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
