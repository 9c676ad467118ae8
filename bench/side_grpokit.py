"""The grpokit side of the benchmark (runs in the project's .venv). Driven by bench/run.py."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def settings(args) -> dict:
    """grpokit's best settings for this workload (what the table's footnote reports)."""
    return {
        "micro_batch_size": args.micro_batch,
        "gradient_checkpointing": False,
        "threads": common.cores(),
        "ref_check_every": 0,
    }


def workload_args(ap, run_dir: str) -> None:
    """The options of a one-off grpokit side (bench/profile_step.py, bench/update_check.py): the
    benchmark's SmolLM2 workload by default."""
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--fixed-length", action="store_true")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--run-dir", default=run_dir)


def build(args):
    import torch

    torch.set_num_threads(common.cores())
    from grpokit.config import config_from_dict
    from grpokit.rewards import register
    from grpokit.train import build_run

    register("bench_partial_credit")(common.partial_credit)
    register("bench_boxed_match")(common.boxed_match)
    n = (common.AGENT_PROMPTS_PER_STEP if args.agent else common.PROMPTS_PER_STEP) * common.GROUP_SIZE
    # the agent configuration: the calculator tool (bench/common.py, on sys.path), the example's limits
    agent = {"tools": ["common:calculator"],
             "agent": {"max_turns": common.AGENT_MAX_TURNS, "max_observation_tokens": 64, "tool_timeout_s": 5}} \
        if args.agent else {}
    cfg = config_from_dict({
        "model": {"path": args.model, "dtype": "float32", "device": "cpu", "gradient_checkpointing": False},
        "data": {"path": args.data, "eval_split": 0},           # no held-out evaluation inside the timed steps
        "rollout": {"group_size": common.GROUP_SIZE, "batch_size": n, "temperature": common.TEMPERATURE,
                    "max_new_tokens": args.max_new_tokens, "ignore_eos": args.fixed_length, **agent},
        "algorithm": {"advantage": "grpo", "loss_agg": "token_mean", "mu": 1, "mini_batches": 1,
                      "eps_low": common.EPSILON, "eps_high": common.EPSILON,
                      "kl": {"beta": common.BETA, "estimator": "k3", "controller": "fixed"}},
        "rewards": [{"name": "bench_boxed_match" if args.agent else "bench_partial_credit"}],
        "optim": {"lr": common.LR, "max_grad_norm": common.MAX_GRAD_NORM, "micro_batch_size": args.micro_batch},
        "train": {"steps": args.steps, "seed": common.SEED, "run_dir": args.run_dir,
                  "save_every": 0, "sample_every": 0, "progress": False},
        "monitor": {"sinks": ["jsonl"]},
        # the reference-integrity probe is extra work TRL does not do: off for a like-for-like step
        "guard": {"ref_check_every": 0},
    })
    return build_run(cfg, health=False)


def decode_check(model, rows: int, context: int, temperature: float, steps: int = 4, rounds: int = 5,
                 group: int | None = None, prompt_len: int | None = None) -> dict:
    """A decoding step of the lean decoder (one token per row through every layer, then sampling)
    against the time its own matmuls take alone, at the same number of rows.

    The rows are rows / `group` prompts of `prompt_len` random tokens (default: one prompt, the
    whole context), each sampled `group` times as in a GRPO step; the decoder is prefilled with
    them, and the cache columns from there to `context` are filled as if those tokens had been
    generated. Each round then times `steps` decoding steps at the columns after it (every round
    rewrites the same columns: the same work each time) and `steps` passes of the step's matmuls
    alone (the same packed weights, inputs of the same shapes), in alternation so that load on the
    machine falls on both; with one thread, in the thread's CPU time. Reported: each one's best
    round, per step, and the ratio of the two bests."""
    import torch

    from grpokit.gemm import linear
    from grpokit.rollout import native
    from grpokit.rollout.base import SamplingParams, sample_next
    from grpokit.rollout.decoder import LeanDecoder

    group = group or rows
    prompt_len = prompt_len or context
    with torch.inference_mode():
        dec = LeanDecoder(model, rows=rows)
        dec.alloc(rows, context + steps, prompts=rows // group, prefix=prompt_len)
        cos_t, sin_t = dec.rope_table(context + steps)
        gen = torch.Generator().manual_seed(0)
        vocab = dec.embed.shape[0]
        prompt = torch.randint(0, vocab, (rows // group, prompt_len), generator=gen)
        first = dec.forward(prompt, 0, cos_t[:prompt_len], sin_t[:prompt_len], None, expand=group)
        base = 0 if dec.split else prompt_len
        for c in (*dec.k, *dec.v):                    # the tokens generated so far, as cache entries
            c[:, :, base:base + context - prompt_len] = torch.randn(c[:, :, base:base + context - prompt_len].shape,
                                                                    generator=gen)
        dec.filled = base + context - prompt_len
        params = SamplingParams(temperature=temperature)
        hidden = dec.embed.shape[1]
        x_h = torch.randn(rows, hidden)
        x_o = torch.randn(rows, dec.n_heads * dec.head_dim)
        inter = model.config.intermediate_size
        x_d = torch.randn(rows, inter)

        def decode():
            tok = sample_next(first, params, gen)[0]
            for t in range(steps):
                s = context + t
                logits = dec.forward(tok[:, None], s, cos_t[s], sin_t[s], None)
                tok = sample_next(logits, params, gen)[0]

        def matmuls():
            for _ in range(steps):
                for p in dec.layers:
                    linear(x_h, p.w_qkv, p.b_qkv)
                    linear(x_o, p.w_o, p.b_o)
                    linear(x_h, p.w_gu, p.b_gu)
                    linear(x_d, p.w_down, p.b_down)
                linear(x_h, dec.w_head, dec.b_head)

        import time
        # one thread: its CPU time, which other load on the machine does not inflate
        clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
        decode(), matmuls()                                          # warm-up
        t_dec, t_mm = [], []
        for _ in range(rounds):
            for fn, out in ((decode, t_dec), (matmuls, t_mm)):
                t = clock()
                fn()
                out.append((clock() - t) / steps)
    cfg = model.config
    kv = cfg.num_key_value_heads * dec.head_dim
    per_layer = hidden * (dec.n_heads * dec.head_dim + 2 * kv) + dec.n_heads * dec.head_dim * hidden + 3 * hidden * inter
    flops = 2 * rows * (cfg.num_hidden_layers * per_layer + hidden * vocab)
    return {"rows": rows, "context": context, "group": group, "prompt_len": prompt_len, "split_cache": dec.split,
            "native_attention": native.attend_fn() is not None, "step_s": min(t_dec), "matmul_s": min(t_mm),
            "ratio": min(t_dec) / min(t_mm), "matmul_gflop_per_s": flops / min(t_mm) / 1e9,
            "step_s_all": t_dec, "matmul_s_all": t_mm}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--fixed-length", action="store_true")
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=common.WARMUP_STEPS + common.STEPS)
    ap.add_argument("--agent", action="store_true", help="multi-turn episodes with the calculator tool")
    ap.add_argument("--decode-check", action="store_true",
                    help="time a decoding step against its matmuls alone (decode_check) before the steps")
    args = ap.parse_args()
    t0 = time.perf_counter()
    trainer = build(args)
    setup_s = time.perf_counter() - t0
    extra = {}
    if args.decode_check:
        import torch
        prompt = trainer.encoder.encode(trainer.dataset[0]["prompt"])
        rows = common.PROMPTS_PER_STEP * common.GROUP_SIZE
        # mid-completion: the prompt and half of the new tokens in the cache
        check = dict(rows=rows, context=len(prompt) + args.max_new_tokens // 2, temperature=common.TEMPERATURE,
                     group=common.GROUP_SIZE, prompt_len=len(prompt))
        extra["decode_check"] = decode_check(trainer.model, **check)          # the run's threads, wall clock
        threads = torch.get_num_threads()
        torch.set_num_threads(1)                # one thread, its CPU time: what other load does not inflate
        try:
            extra["decode_check_1t"] = decode_check(trainer.model, **check)
        finally:
            torch.set_num_threads(threads)

    def step() -> dict:
        t, c = time.perf_counter(), time.process_time()
        m = trainer.step()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        trainer.step_idx += 1
        batch = trainer.last_batch
        return {
            "step_s": wall, "cpu_s": cpu,
            "generation_s": m["time/rollout"],
            "reward_s": m["time/reward"],
            "reference_s": m["time/logprobs"],
            "update_s": m["time/update"],
            "grad_norm": m["optim/grad_norm"],
            "reward_std": m["reward/std"],
            "prompt_lens": [len(p) for p in batch.prompt_ids],
            "completion_lens": batch.lengths.tolist(),
            "rss_mb": common.peak_rss_mb(),
            "tool_calls": m.get("agent/tool_calls", 0.0),
        }

    import torch  # noqa: F811
    common.serve(step, {"setup_s": setup_s, "settings": settings(args), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), **extra})


if __name__ == "__main__":
    main()
