"""The `agent/*` metrics of a batch of episodes (sums a data-parallel job adds over ranks first),
and the columns the reward functions see for them."""

from __future__ import annotations

from grpokit.rollout.episodes.runner import STOP_REASONS, EpisodeRunner

EPISODE_COUNTS = ("episodes", "turns", "tool_calls", "tool_errors", "tool_timeouts", "parse_failures",
                  "action_tokens", "tokens", "time_generate", "time_env", "time_wait", "engine_calls", "turn_rows",
                  *(f"stop_{r}" for r in STOP_REASONS))


def episode_counts(records: list[dict], action_tokens: int, all_tokens: int, timings: list[dict] = ()) -> list[float]:
    """The sums behind `agent/*` (EPISODE_COUNTS, in order) of a batch's episode records and its
    rollouts' `timing`s: a data-parallel job adds them over ranks before `episode_metrics`, so its
    metrics are the job's, not a mean of ranks' ratios."""
    def total(key):
        return sum(r.get(key, 0) for r in records)
    out = [len(records), total("turns"), total("tool_calls"), total("tool_errors"), total("tool_timeouts"),
           total("parse_failures"), action_tokens, all_tokens, total("time_generate"), total("time_env"),
           total("time_wait"), sum(t.get("engine_calls", 0) for t in timings), sum(t.get("turn_rows", 0) for t in timings)]
    out += [sum(r["stop_reason"] == reason for r in records) for reason in STOP_REASONS]
    return [float(v) for v in out]


def episode_metrics(counts: list[float], tool_latencies: list[float] = ()) -> dict[str, float]:
    """`agent/*` metrics of a batch's `episode_counts` (summed over ranks where there are several)
    and its tool calls' latencies in seconds (every rank's)."""
    c = dict(zip(EPISODE_COUNTS, counts))
    n = max(c["episodes"], 1.0)
    out = {"agent/turns_mean": c["turns"] / n, "agent/tool_calls": c["tool_calls"],
           "agent/tool_errors": c["tool_errors"], "agent/tool_timeouts": c["tool_timeouts"],
           "agent/parse_failures": c["parse_failures"],
           "agent/obs_token_frac": (c["tokens"] - c["action_tokens"]) / max(c["tokens"], 1.0),
           "agent/episode_generate_s": c["time_generate"] / n, "agent/episode_env_s": c["time_env"] / n,
           "agent/episode_wait_s": c["time_wait"] / n}
    if c["engine_calls"]:
        out["agent/turn_batch_mean"] = c["turn_rows"] / c["engine_calls"]
    for reason in STOP_REASONS:
        out[f"agent/stop_{reason}"] = c[f"stop_{reason}"] / n
    if tool_latencies:
        lat = sorted(tool_latencies)
        for q in (50, 90, 99):
            out[f"agent/tool_latency_p{q}"] = lat[min(len(lat) - 1, int(q / 100 * len(lat)))]
        out["agent/tool_latency_max"] = lat[-1]
    return out


def episode_columns(runner: EpisodeRunner, prompt_ids: list[list[int]], texts: list[str], records: list[dict],
                    columns: dict) -> tuple[list[str], list[str]]:
    """(prompts, completions) for the reward functions of a batch of episodes, and their columns:
    the completion a reward scores is the episode's final assistant turn; `columns` gains `episode`
    (the whole text after the prompt), `messages`, `env`, `env_reward`, `stop_reason`, `turns`,
    `tool_calls` and `tool_errors`."""
    columns.update(episode=list(texts), messages=[r["messages"] for r in records], env=[r["env"] for r in records],
                   env_reward=[r.get("env_reward") for r in records], stop_reason=[r["stop_reason"] for r in records],
                   turns=[r["turns"] for r in records], tool_calls=[r["tool_calls"] for r in records],
                   tool_errors=[r["tool_errors"] for r in records])
    prompts = [runner.tok.decode(p, skip_special_tokens=False) for p in prompt_ids]
    return prompts, [r["final"] for r in records]
