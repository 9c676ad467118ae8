"""The TRL side of the benchmark (runs in .venv-bench, with trl pinned). Driven by bench/run.py.

TRL's `GRPOTrainer` owns its loop (`Trainer.train`), so the controller's "step" word is awaited in
a callback's `on_step_begin`; the step's record is sent from `on_log` (after the optimizer step,
when the gradient norm is known). Phase times come from wrapping the trainer's own methods:
`_generate` (tokenise, `model.generate`, decode), `_calculate_rewards`, and
`_generate_and_score_completions` (which adds the reference log-probs and advantages).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--fixed-length", action="store_true")
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=common.WARMUP_STEPS + common.STEPS)
    ap.add_argument("--agent", action="store_true", help="multi-turn episodes with the calculator tool (tools=)")
    args = ap.parse_args()
    t0 = time.perf_counter()

    import torch
    torch.set_num_threads(common.cores())
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = PreTrainedTokenizerFast.from_pretrained(args.model)   # the saved char tokenizer, as saved
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    with open(args.data) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    n = (common.AGENT_PROMPTS_PER_STEP if args.agent else common.PROMPTS_PER_STEP) * common.GROUP_SIZE
    micro = min(args.micro_batch, n)
    accum = n // micro
    gen_kwargs = {"min_new_tokens": args.max_new_tokens} if args.fixed_length else None
    cfg = GRPOConfig(
        output_dir=args.run_dir, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        use_cpu=True, bf16=False, fp16=False, seed=common.SEED,
        max_steps=args.steps,
        per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        num_generations=common.GROUP_SIZE, max_completion_length=args.max_new_tokens,
        temperature=common.TEMPERATURE, beta=common.BETA, epsilon=common.EPSILON,
        learning_rate=common.LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=common.MAX_GRAD_NORM, loss_type="dapo", scale_rewards="group", num_iterations=1,
        # TRL's defaults turn gradient checkpointing on: off is faster and fits in memory here
        gradient_checkpointing=False,
        generation_kwargs=gen_kwargs, log_completions=False, dataloader_num_workers=0,
        # the agent configuration: turns after the first are tool-calling iterations
        **({"max_tool_calling_iterations": common.AGENT_MAX_TURNS - 1} if args.agent else {}),
    )
    settings = {"per_device_train_batch_size": micro, "gradient_accumulation_steps": accum,
                "gradient_checkpointing": False, "bf16": False, "optim": str(cfg.optim),
                "generation": "model.generate (transformers, DynamicCache)",
                "fixed_length": "generation_kwargs min_new_tokens" if args.fixed_length else None,
                "threads": common.cores()}

    state: dict = {}

    class Phase(TrainerCallback):
        def on_step_begin(self, targs, tstate, control, **kw):
            if not state.get("announced"):
                import trl
                common.say({"ready": {"setup_s": time.perf_counter() - t0, "settings": settings,
                                      "torch": torch.__version__, "trl": trl.__version__,
                                      "threads": torch.get_num_threads()}})
                state["announced"] = True
            line = sys.stdin.readline().strip()
            if line != "step":
                raise SystemExit(0)
            state.update(gen=0.0, reward=0.0, prep=0.0, plens=[], clens=[], t=time.perf_counter(),
                         c=time.process_time())

        def on_step_end(self, targs, tstate, control, **kw):
            state["wall"] = time.perf_counter() - state["t"]
            state["cpu"] = time.process_time() - state["c"]

        def on_log(self, targs, tstate, control, logs=None, **kw):
            if "wall" not in state or logs is None or "grad_norm" not in logs:
                return
            wall = state.pop("wall")
            common.say({"step": {
                "step_s": wall, "cpu_s": state["cpu"], "generation_s": state["gen"], "reward_s": state["reward"],
                "reference_s": state["prep"] - state["gen"] - state["reward"],
                "update_s": wall - state["prep"], "grad_norm": float(logs["grad_norm"]),
                "reward_std": float(logs.get("reward_std", float("nan"))),
                "prompt_lens": state["plens"], "completion_lens": state["clens"],
                "rss_mb": common.peak_rss_mb(), "tool_calls": float(logs.get("tools/call_frequency", 0.0)) * n}})

    trainer = GRPOTrainer(model=model, reward_funcs=[common.boxed_match if args.agent else common.partial_credit],
                          args=cfg, train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[Phase()],
                          **({"tools": [common.calculator]} if args.agent else {}))

    def lens(out):
        prompt_ids, completion_ids, tool_mask = out[0], out[1], out[2]
        state["plens"] += [len(p) for p in prompt_ids]
        # with tools, the tokens the policy sampled (tool_mask 1), tool results not counted
        state["clens"] += ([sum(m) for m in tool_mask] if tool_mask is not None else [len(c) for c in completion_ids])

    trainer._generate = common.timed(state, "gen", trainer._generate, lens)
    trainer._calculate_rewards = common.timed(state, "reward", trainer._calculate_rewards)
    trainer._generate_and_score_completions = common.timed(state, "prep", trainer._generate_and_score_completions)
    trainer.train()
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    common.say({"done": {"peak_rss_mb": common.peak_rss_mb()}})


if __name__ == "__main__":
    main()
