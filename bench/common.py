"""What both sides of the benchmark share: the workload, the reward, the FLOP count, memory probes.

This module is imported by the grpokit side (project `.venv`) and by the TRL side (`.venv-bench`,
where grpokit is not installed), so it depends on the standard library only.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# ---------------------------------------------------------------------------------------- workload
# BENCH_PROMPTS: fewer prompts per step (same G) for a short run on a loaded machine; the table
# states the work it ran
PROMPTS_PER_STEP = int(os.environ.get("BENCH_PROMPTS", "8"))
GROUP_SIZE = 8
TEMPERATURE = 0.8
BETA = 0.02
LR = 1e-5
MAX_GRAD_NORM = 1.0
EPSILON = 0.2
WARMUP_STEPS = 1
STEPS = 10
SEED = 0

# Qwen2 shapes of the two benchmark models (random init, seeded; character-level vocabulary).
SIZES = {
    "small": dict(hidden=128, layers=4, heads=4, intermediate=512),
    "large": dict(hidden=512, layers=8, heads=8, intermediate=2048),
}


def partial_credit(prompts, completions, answer=None, **_):
    """The benchmark reward (same function on both sides): partial credit, so that groups of a
    random-init model have non-zero reward variance and both sides do the full update.

        r = 0.5 * (digits in the completion / its length)
          + 0.5 * (answer characters reproduced at the same position from the completion's start)
              / len(answer)

    `grpokit.rewards.basic.digit_match` pays 0 for any completion longer than the answer, which is
    every completion of a random model (and all of them in the fixed-length variant): the groups
    would have zero variance, zero advantages and a zero gradient. A completion given as chat
    messages (TRL, for conversational prompts) is scored on its text.
    """
    out = []
    for c, a in zip(completions, answer if answer is not None else [None] * len(completions)):
        if isinstance(c, list):          # TRL passes chat completions as messages
            c = "".join(m.get("content", "") for m in c)
        c = str(c)
        digits = sum(ch.isdigit() for ch in c) / max(len(c), 1)
        ref = str(a or "")
        hits = sum(x == y for x, y in zip(c, ref)) / len(ref) if ref else 0.0
        out.append(0.5 * digits + 0.5 * hits)
    return out


# ------------------------------------------------------------------------- the agent configuration
# The multi-turn configuration (SmolLM2 with a calculator tool, `--variants agent`): the tool and the
# reward both sides use. The TRL environment has no grpokit, so the tool's evaluator is written here
# with the standard library (grpokit.tasks.calculator has the project's own).
AGENT_PROMPTS_PER_STEP = 4
AGENT_MAX_TURNS = 3


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / and parentheses, e.g. "37 * 48 + 5"
    """
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("only numbers, + - * / and parentheses")

    if len(expression) > 200:
        raise ValueError("too long")
    v = ev(ast.parse(expression, mode="eval").body)
    return str(int(v) if float(v).is_integer() else round(v, 6))


def boxed_match(prompts, completions, answer=None, **_):
    """1 when the last \\boxed{} of the final assistant turn holds the answer, else 0 (a completion
    given as chat messages, TRL's, is read at its last assistant message)."""
    import re

    out = []
    for c, a in zip(completions, answer if answer is not None else [None] * len(completions)):
        if isinstance(c, list):
            said = [m.get("content") or "" for m in c if m.get("role") == "assistant"]
            c = said[-1] if said else ""
        found = re.findall(r"\\boxed\{([^{}]*)\}", str(c))
        out.append(float(bool(found) and found[-1].strip() == str(a).strip()))
    return out


# ------------------------------------------------------------------------------------------- FLOPs
@dataclass(frozen=True)
class Dims:
    """What the FLOP count needs of a dense decoder (Qwen2 / Llama)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    qkv_bias: bool = True

    @property
    def layer_matmul_params(self) -> int:
        """Weights touched by matmuls in one layer (q, k, v, o; gate, up, down)."""
        d = self.hidden // self.heads
        kv = self.kv_heads * d
        return self.hidden * (self.hidden + 2 * kv) + self.hidden * self.hidden + 3 * self.hidden * self.intermediate

    def token_forward(self, context: int, head: bool) -> int:
        """Forward FLOPs of one token attending to `context` positions (itself included):
        2 per multiply-add in every matmul, plus QK^T and AV (2 * context * hidden each) per layer,
        plus the LM head (2 * hidden * vocab) when its logits are needed."""
        per_layer = 2 * self.layer_matmul_params + 4 * context * self.hidden
        return self.layers * per_layer + (2 * self.hidden * self.vocab if head else 0)

    def sequence_forward(self, start: int, n: int, head_from: int) -> int:
        """Forward FLOPs of positions start..start+n-1 of one sequence (position p attends to p+1
        positions); positions >= head_from also go through the LM head."""
        lin = 2 * self.layer_matmul_params * self.layers * n
        # sum over p of 4 * (p + 1) * hidden * layers
        ctx = sum(range(start + 1, start + n + 1))
        att = 4 * self.hidden * self.layers * ctx
        heads = max(0, start + n - max(head_from, start))
        return lin + att + 2 * self.hidden * self.vocab * heads


def step_flops(dims: Dims, prompt_lens: list[int], completion_lens: list[int], group_size: int) -> dict:
    """Model FLOPs of the useful work of one GRPO step (mu = 1, beta > 0), the same count for
    both sides whatever each actually computes:

    - generation: each prompt's prefill once (LM head on its last position only), then one decode
      forward per completion token but the last (the last token is sampled, never fed back);
    - reference: one forward over the same positions (each prompt once per group; every completion
      token but the last, which predicts nothing), LM head on the positions that predict the
      completion: the same count as generation;
    - policy: forward + backward (3x the reference forward).

    Padding, finished rows kept in a batch and prompts recomputed per sample are not counted.
    `prompt_lens` and `completion_lens` are per sample (group after group)."""
    gen = 0
    for i, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
        if i % group_size == 0:
            gen += dims.sequence_forward(0, p, head_from=p - 1)
        if c > 1:
            gen += dims.sequence_forward(p, c - 1, head_from=p)
    return {"generation": gen, "reference": gen, "policy": 3 * gen, "total": 5 * gen}


# --------------------------------------------------------------------------------------- profiling
def top_ops(prof, n: int) -> tuple[list[dict], float]:
    """The `n` operations of a `torch.profiler` run with the most self CPU time (op, self_s, share of
    the total, calls), and that total in seconds."""
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in ops)
    return [{"op": e.key, "self_s": round(e.self_cpu_time_total / 1e6, 3),
             "share": round(e.self_cpu_time_total / max(total_us, 1), 3), "calls": e.count}
            for e in ops[:n]], total_us / 1e6


def print_top_ops(top: list[dict]) -> None:
    for r in top:
        print(f"  {r['op'][:50]:<50} {r['self_s']:8.2f} s  {100 * r['share']:5.1f}%  {r['calls']:>8} calls")


# ------------------------------------------------------------------------------------------ memory


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB: VmHWM, the high-water mark of this
    program's own address space. (`getrusage`'s ru_maxrss is no good here: Linux carries the
    parent's peak across fork + exec, so every side would report at least the controller's.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cores() -> int:
    """Threads each side uses: the cores available (BENCH_THREADS overrides, for profiling)."""
    if os.environ.get("BENCH_THREADS"):
        return int(os.environ["BENCH_THREADS"])
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------- protocol
# Each side runs in its own process and waits for the controller's word before every step, so the
# controller can alternate the two sides step by step (A B A B ...). Lines that start with TAG
# carry JSON; anything else a library prints is ignored.
TAG = "@@bench "


def say(obj) -> None:
    import json
    import sys
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(step_fn, ready: dict) -> None:
    """Announce `ready`, then run `step_fn()` (-> dict) on each 'step' line of stdin until 'quit'."""
    import sys
    say({"ready": ready})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            say({"step": step_fn()})
        elif cmd == "quit":
            break
    say({"done": {"peak_rss_mb": peak_rss_mb()}})


def start_rollout_server(model_dir, log_path, *, device: str = "cpu", threads: int | None = None,
                         timeout_s: float = 600.0) -> tuple[subprocess.Popen, str]:
    """A `grpokit rollout-server` process on a free port: (process, "HOST:PORT"), read from its log.
    The caller kills it. Runs the project's interpreter with the repository on the path."""
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    log_path = Path(log_path)
    proc = subprocess.Popen([sys.executable, "-m", "grpokit.cli", "rollout-server", "--model", str(model_dir),
                             "--port", "0", "--device", device], stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            cwd=repo, env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(r"listening on (\S+:\d+)", log_path.read_text())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the rollout server did not start: {log_path.read_text()[-2000:]}")


def timed(state: dict, name: str, fn, after=None):
    """`fn` wrapped to add its seconds to `state[name]` (and hand its result to `after`): how both TRL
    sides time the trainer's own methods."""
    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        state[name] += time.perf_counter() - t
        if after:
            after(out)
        return out
    return wrapper
