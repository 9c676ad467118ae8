"""The TRL side of bench/layouts.py: TRL's GRPOTrainer on the same work, with vLLM colocated when a GPU
and vLLM are there (`use_vllm=True, vllm_mode="colocate"`), else its own `model.generate`. Runs in an
environment with trl (e.g. .venv-bench); writes the same summary keys as the grpokit layouts.

Phase times come from wrapping the trainer's own methods, as in bench/side_trl.py: `_generate` is
generation; the rest of a step (reference log-probs, advantages, the update) is training; TRL
syncs vLLM's weights inside generation (`_move_model_to_vllm`), so its sync time is timed apart
when that method exists and taken out of generation.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--model", "--data", "--out", "--run-dir"):
        ap.add_argument(name, required=True)
    for name in ("--steps", "--prompts", "--group-size", "--max-new-tokens"):
        ap.add_argument(name, type=int, required=True)
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    colocate = cuda and importlib.util.find_spec("vllm") is not None
    tok = PreTrainedTokenizerFast.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32)
    rows = [json.loads(line) for line in open(args.data) if line.strip()]
    n = args.prompts * args.group_size
    cfg = GRPOConfig(
        output_dir=args.run_dir, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        use_cpu=not cuda, bf16=cuda, fp16=False, seed=0, max_steps=args.steps,
        per_device_train_batch_size=n, gradient_accumulation_steps=1, num_generations=args.group_size,
        max_completion_length=args.max_new_tokens, temperature=1.0, beta=0.02, learning_rate=1e-5,
        lr_scheduler_type="constant", warmup_steps=0, gradient_checkpointing=False, log_completions=False,
        generation_kwargs={"min_new_tokens": args.max_new_tokens} if not colocate else None,
        **({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3} if colocate else {}))
    state = {"steps": [], "gen": 0.0, "sync": 0.0, "clens": []}

    class Phase(TrainerCallback):
        def on_step_begin(self, targs, tstate, control, **kw):
            state.update(gen=0.0, sync=0.0, clens=[], t=time.perf_counter())

        def on_step_end(self, targs, tstate, control, **kw):
            wall = time.perf_counter() - state["t"]
            state["steps"].append({"step_s": wall, "generation_s": state["gen"] - state["sync"], "sync_s": state["sync"],
                                   "training_s": wall - state["gen"], "tokens": sum(state["clens"])})

    def exact(prompts, completions, answer=None, **_):
        return [float(c.strip() == str(a)) for c, a in zip(completions, answer or [""] * len(completions))]

    trainer = GRPOTrainer(model=model, reward_funcs=[exact], args=cfg, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=[Phase()])

    trainer._generate = common.timed(state, "gen", trainer._generate, lambda out: state["clens"].extend(len(c) for c in out[1]))
    if hasattr(trainer, "_move_model_to_vllm"):
        trainer._move_model_to_vllm = common.timed(state, "sync", trainer._move_model_to_vllm)
    trainer.train()
    steps = state["steps"][1:] or state["steps"]

    def mean(key):
        return statistics.fmean(s[key] for s in steps)

    step = mean("step_s")
    out = {"steps": len(steps), "step_s": step, "trajectories_per_s": n / step, "tokens_per_s": mean("tokens") / step,
           "generation_s": mean("generation_s"), "training_s": mean("training_s"), "sync_s": mean("sync_s"),
           "engine": "vLLM colocate" if colocate else "model.generate"}
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
