"""The memory order (the practitioner's rule R6) applied to an estimate: each cut in turn with its
estimate and its cost, the first that fits, the plan as text and as a config file
(`grpokit plan-memory`). The estimate itself is grpokit.train.memory."""

from __future__ import annotations

from dataclasses import dataclass

from grpokit.train.memory import GiB, MiB, Estimate, Setup, Shape, estimate
from grpokit.train.memory_costs import COSTS


@dataclass
class PlanRow:
    step: str
    overrides: dict[str, object]            # cumulative
    estimate: Estimate
    note: str = ""
    cost: str = ""

    @property
    def peak(self) -> float:
        return self.estimate.peak


def plan(shape: Shape, s: Setup, budget: float, *, lr: float | None = None, prompts_per_step: int | None = None,
         mini_batches: int = 1) -> list[PlanRow]:
    """Each step of the memory order applied in turn (cumulatively), with its estimate. Before them,
    when over budget, dynamic-sampling rounds sized by the keep rate go back to fixed width (a step
    keeps as many groups, over more, thinner generations: slower, nothing else changes); after the rule's steps,
    if nothing fits yet, the micro-batch is halved (exact: the gradient is unchanged)."""
    rows = [PlanRow("as configured", {}, estimate(shape, s))]
    over: dict[str, object] = {}

    def add(name: str, changes: dict, new: Setup, note: str = "", cost: str = ""):
        nonlocal s
        over.update(changes)
        s = new
        rows.append(PlanRow(name, dict(over), estimate(shape, s), note, COSTS.get(cost, "")))

    def same(name: str, note: str):
        rows.append(PlanRow(name, dict(over), rows[-1].estimate, note))

    def replaced(**kw) -> Setup:
        return Setup(**{**s.__dict__, **kw})

    if s.wide_rounds > 1 and rows[-1].peak > budget:     # costs speed only: before the order
        add("dynamic-sampling rounds of fixed width", {"rollout.dynamic_width": "fixed"}, replaced(wide_rounds=1),
            "as many groups kept", cost="fixed rounds")
    if s.grad_ckpt:
        same("gradient checkpointing", "already on")
    else:
        add("gradient checkpointing", {"model.gradient_checkpointing": True}, replaced(grad_ckpt=True),
            cost="gradient checkpointing")
    if s.lora:
        same("LoRA", "already on")
    else:
        ch: dict[str, object] = {"lora.enabled": True}
        if lr is not None and lr < 1e-5:
            ch["optim.lr"] = 1e-4            # the LoRA rate of "LoRA-GRPO" (docs/training.md): 1e-4 to 2e-4
        ref = "adapter_off" if s.reference != "none" else "none"
        add(f"LoRA r={s.rank}, adapter-off reference", ch, replaced(lora=True, reference=ref), cost="LoRA")
    if s.four_bit:
        same("4-bit base weights", "already on")
    else:
        add("4-bit base weights (QLoRA)", {"lora.load_in_4bit": True}, replaced(four_bit=True), cost="4-bit")
    if s.reference != "copy":
        same("reference offload to CPU", "no reference copy to offload" if s.reference == "adapter_off"
             else "beta = 0: no reference")
    elif s.device == "cpu":
        same("reference offload to CPU", "the policy is on the CPU already")
    elif s.ref_device != "same":
        same("reference offload to CPU", "already off the GPU")
    else:
        add("reference offload to CPU", {"algorithm.kl.ref_device": "cpu"}, replaced(ref_device="cpu"),
            cost="reference offload")
    P = prompts_per_step or max(1, s.batch_size // s.group_size)
    g = s.group_size
    while rows[-1].peak > budget and g > 2:
        g = max(2, g // 2)
        n = P * g
        if n % mini_batches:
            continue
        add(f"smaller G: {g}", {"rollout.group_size": g, "rollout.batch_size": n},
            replaced(group_size=g, batch_size=n), cost="smaller G")
    mb = min(s.micro_batch, s.batch_size)
    while rows[-1].peak > budget and mb > 1:
        mb = max(1, mb // 2)
        add(f"micro-batch {mb} (beyond the memory order)", {"optim.micro_batch_size": mb}, replaced(micro_batch=mb),
            "same gradient", cost="micro-batch")
    return rows


def first_fit(rows: list[PlanRow], budget: float) -> PlanRow | None:
    return next((r for r in rows if r.peak <= budget), None)


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def format_plan(rows: list[PlanRow], budget: float) -> str:
    e0 = rows[0].estimate
    sh, s = e0.shape, e0.setup
    lines = [f"model: {sh.model_type}, {sh.params / 1e6:.1f} M parameters, {sh.layers} layers, hidden {sh.hidden}, "
             f"vocab {sh.vocab}; device {s.device}, {s.dtype_bytes * 8}-bit weights; prompt <= {s.prompt_tokens} "
             f"tokens, {s.max_new_tokens} new; budget {fmt_bytes(budget)}"
             + (f"; per rank of {s.world_size} ({s.distributed})" if s.world_size > 1 else ""),
             "", "as configured:"]
    for k, v in e0.parts.items():
        if v:
            lines.append(f"  {k:12s} {fmt_bytes(v):>12s}")
    lines.append(f"  peak phase: {e0.peak_phase} ({', '.join(f'{k} {fmt_bytes(v)}' for k, v in e0.phases.items())})")
    lines += ["", f"{'':2s}{'step (memory order, cumulative)':44s}{'estimate':>12s}  fits  note / cost"]
    fit = first_fit(rows, budget)
    for r in rows:
        mark = "->" if r is fit else "  "
        tail = "; ".join(x for x in (r.note, f"cost: {r.cost}" if r.cost else "") if x)
        lines.append(f"{mark}{r.step:44s}{fmt_bytes(r.peak):>12s}  {'yes ' if r.peak <= budget else 'no  '}  {tail}")
    lines.append("")
    if fit is None:
        lines.append("nothing fits: lower rollout.max_new_tokens or use a smaller model")
    elif not fit.overrides:
        lines.append("fits as configured")
    else:
        lines.append("first fit: " + " ".join(f"{k}={_yaml_value(v)}" for k, v in fit.overrides.items()))
    return "\n".join(lines)


def _yaml_value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def overrides_yaml(overrides: dict[str, object], base: str) -> str:
    """A config file that extends `base` with the planner's overrides."""
    import yaml

    tree: dict = {"base": base}
    for key, v in overrides.items():
        node = tree
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return "# written by grpokit plan-memory --apply\n" + yaml.safe_dump(tree, sort_keys=False)


