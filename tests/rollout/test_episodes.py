"""Multi-turn episodes (grpokit.rollout.episodes): the environment API, tool-call parsing, the token
layer (engine ids + template deltas, never re-tokenized), masks, budgets and faults, on a scripted
engine whose every token is known, and end to end on a tiny model."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from grpokit.errors import ConfigError
from grpokit.rollout.base import RolloutBatch, SamplingParams
from grpokit.rollout.episodes import EnvSpec, EpisodeRunner, EpisodeSettings, load_object
from grpokit.rollout.episodes.chat import ChatTokens
from grpokit.rollout.episodes.parse import parse_tool_calls
from grpokit.tasks.tiny import build_chat_tokenizer

CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ +-*/=?.,:;()[]{}<>!'\"#_\n|"


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer(CHARS, words=("12",))


# ------------------------------------------------------------------------------- environments

class CalcEnv:
    """A calculator environment whose episodes remember their calls."""

    def reset(self, **row):
        self.answer, self.calls = row.get("answer"), []
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: digits and + - *, e.g. 12*3
        """
        self.calls.append(expression)
        if expression == "boom":
            raise ValueError("cannot evaluate boom")
        if expression == "slow":
            time.sleep(5)
        return str(eval(expression, {"__builtins__": {}}))   # noqa: S307 - digits and operators in these tests

    def reward(self) -> float:
        return float(len(self.calls))


class GuessEnv:
    """The text form: answers higher / lower until the number is guessed."""

    def reset(self, **row):
        self.target = int(row["answer"])
        return f"Guess my number between 0 and 9 (try {row['prompt']})."

    def step(self, text: str):
        try:
            g = int(text.strip()[-1])
        except (ValueError, IndexError):
            return "Say one digit."
        if g == self.target:
            return None
        return "higher" if g < self.target else "lower"


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: what to upper-case
    """
    return text.upper()


def test_an_environment_s_public_methods_are_its_tools_with_schemas_from_their_signatures():
    spec = EnvSpec(CalcEnv)
    assert [s["function"]["name"] for s in spec.schemas] == ["calculator"]
    params = spec.schemas[0]["function"]["parameters"]
    assert params["properties"]["expression"]["type"] == "string" and params["required"] == ["expression"]
    assert spec.has_reward and not spec.text_form
    assert EnvSpec(GuessEnv).text_form and EnvSpec(GuessEnv).schemas == []
    assert [s["function"]["name"] for s in EnvSpec(tools=[shout]).schemas] == ["shout"]


def test_bad_environments_and_tools_are_one_line_errors():
    class NoDoc:
        def reset(self, **row):
            return None

        def tool(self, x: int) -> int:
            return x

    class Both(GuessEnv):
        def tool(self, x: int) -> int:
            """A tool.

            Args:
                x: a number
            """
            return x

    class Nothing:
        def reset(self, **row):
            return None

    for bad, match in [(NoDoc, "tool tool"), (Both, "both step"), (Nothing, "no tools"), (int, "no reset")]:
        with pytest.raises(ConfigError, match=match) as err:
            EnvSpec(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="not both"):
        EnvSpec(CalcEnv, [shout])
    for spec, match in [("nocolon", "MODULE:NAME"), ("no_such_module_x:Y", "no module named"),
                        ("grpokit.rollout:NoSuchThing", "has no attribute"), ("missing/envs.py:E", "file not found")]:
        with pytest.raises(ConfigError, match=match):
            load_object(spec, "rollout.env")


def test_an_environment_in_a_file_or_in_the_current_directory_is_found(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text("from tests.rollout.agent_envs import CalcEnv as Env\n")
    assert load_object(f"{tmp_path / 'my_envs.py'}:Env", "rollout.env").__name__ == "CalcEnv"
    monkeypatch.chdir(tmp_path)
    assert load_object("my_envs:Env", "rollout.env").__name__ == "CalcEnv"     # a console script's sys.path lacks it


@pytest.mark.parametrize("text, calls, error", [
    ("The answer is 4.", [], None),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>',
     [("calculator", {"expression": "2+2"})], None),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>',
     [("a", {}), ("b", {"x": 1})], None),
    ('<tool_call>{"name": "a", "arguments": {}}', [], "not closed"),
    ("<tool_call>{name: a}</tool_call>", [], "not JSON"),
    ('<tool_call>["a"]</tool_call>', [], "JSON object"),
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', [], "must be a JSON object"),
])
def test_hermes_tool_calls_are_parsed_or_refused_with_the_reason(text, calls, error):
    p = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in p.calls] == calls
    assert (p.error is None) if error is None else (error in p.error)


# ------------------------------------------------------------------------------- the token layer

class ScriptedEngine:
    """Answers each turn from `script(turn, sample)`: a list of token ids (EOS included when the
    turn ends), with known log-probs (-0.01 * (turn + 1) per token)."""

    owns_weights = False

    def __init__(self, tokenizer, script):
        self.tok, self.script = tokenizer, script
        self.eos_ids = [tokenizer.eos_token_id]
        self.calls: list[tuple[list[list[int]], int, int]] = []     # (prompts, n, max_new_tokens)

    def generate(self, prompt_ids, params, generator=None):
        self.calls.append(([list(p) for p in prompt_ids], params.n, params.max_new_tokens))
        rows, lps = [], []
        for p in prompt_ids:
            turn = self.tok.decode(p).count("<|im_start|>assistant") - 1
            for k in range(params.n):
                ids = list(self.script(turn, k))[:params.max_new_tokens]
                rows.append(ids)
                lps.append([-0.01 * (turn + 1)] * len(ids))
        L = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), L), dtype=torch.long)
        mask = torch.zeros_like(ids)
        lp = torch.zeros((len(rows), L))
        for i, (r, q) in enumerate(zip(rows, lps)):
            ids[i, :len(r)], mask[i, :len(r)], lp[i, :len(r)] = torch.tensor(r), 1, torch.tensor(q)
        fin = ["eos" if r and r[-1] in self.eos_ids else "length" for r in rows]
        return RolloutBatch(prompt_ids=[p for p in prompt_ids for _ in range(params.n)], completion_ids=ids,
                            completion_mask=mask, sampler_logprobs=lp, finish_reason=fin,
                            completions=self.tok.batch_decode(ids.tolist()))


def said(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def call(expr: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + expr + '"}}</tool_call>'


def run(tok, env, script, *, rows=None, n=2, budget=400, **settings):
    engine = ScriptedEngine(tok, script)
    spec = env if isinstance(env, EnvSpec) else EnvSpec(env)
    runner = EpisodeRunner(engine, tok, spec, EpisodeSettings(**settings))
    rows = rows or [{"prompt": "What is 12*3?", "answer": 36}]
    return runner.run(rows, SamplingParams(n=n, max_new_tokens=budget)), engine, runner


def test_episode_ids_are_the_engine_s_ids_plus_template_deltas(tok):
    turns = [said(tok, call("12*3")), said(tok, "It is 36.")]
    out, engine, runner = run(tok, CalcEnv, lambda t, k: turns[t])
    chat = runner.chat
    ep = out.episodes[0]
    assert ep["stop_reason"] == "stop" and ep["turns"] == 2 and ep["tool_calls"] == 1 and ep["final"] == "It is 36."
    row = out.completion_ids[0, :int(out.completion_mask[0].sum())].tolist()
    act = out.action_mask[0, :len(row)].tolist()
    # the sampled tokens are the engine's, in order, and nothing else is marked as sampled
    assert [t for t, a in zip(row, act) if a] == turns[0] + turns[1]
    # the rest is the template's delta: the whole sequence renders the conversation exactly
    convo = ep["messages"]
    assert convo[2] == {"role": "tool", "content": "36", "name": "calculator"}
    full = out.prompt_ids[0] + row
    assert tok.decode(full) + "\n" == chat.render(convo, False)
    obs = [t for t, a in zip(row, act) if not a]
    assert tok.decode(obs) == "\n<|im_start|>tool\n36<|im_end|>\n<|im_start|>assistant\n"
    # sampler log-probs: the engine's on sampled tokens, 0 on observation tokens
    lp = out.sampler_logprobs[0, :len(row)].tolist()
    assert all(abs(x - (-0.01 if i < len(turns[0]) else -0.02)) < 1e-7
               for i, x in enumerate(v for v, a in zip(lp, act) if a))
    assert all(x == 0.0 for x, a in zip(lp, act) if not a)
    # the first turn of a prompt's episodes was one request with n=G; the next, one per episode
    assert engine.calls[0][1:] == (2, 400) and len(engine.calls[0][0]) == 1
    assert engine.calls[1][1] == 1 and len(engine.calls[1][0]) == 2
    assert out.episodes[0]["env"].calls == ["12*3"] and out.episodes[0]["env_reward"] == 1.0


def test_ids_that_would_re_encode_differently_are_kept_as_sampled(tok):
    twelve = tok.convert_tokens_to_ids("12")              # decodes to "12"; "12" encodes to "1", "2"
    turn0 = tok('<tool_call>{"name": "calculator", "arguments": {"expression": "', add_special_tokens=False)["input_ids"] \
        + [twelve] + tok('*2"}}</tool_call>', add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    out, _, _ = run(tok, CalcEnv, lambda t, k: turn0 if t == 0 else said(tok, "24"), n=1)
    row = out.completion_ids[0].tolist()
    assert twelve in row                                   # the engine's id, not "1", "2"
    text = tok.decode(turn0[:-1])
    assert tok(text, add_special_tokens=False)["input_ids"] != turn0[:-1]     # it would have drifted
    assert out.episodes[0]["env"].calls == ["12*2"] and out.episodes[0]["final"] == "24"


def rewriting_tokenizer():
    """A ChatML template that drops an earlier assistant turn's reasoning (`<think>...</think>`),
    as some thinking templates do: not prefix-preserving."""
    rewriting = build_chat_tokenizer(CHARS)
    rewriting.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return rewriting


def test_a_template_that_rewrites_earlier_turns_is_refused_as_one_sequence(tok):
    rewriting = rewriting_tokenizer()
    assert ChatTokens(tok, EnvSpec(CalcEnv).schemas).prefix_preserving()
    assert not ChatTokens(rewriting, EnvSpec(CalcEnv).schemas).prefix_preserving()
    with pytest.raises(ConfigError, match="not prefix-preserving") as err:
        EpisodeRunner(ScriptedEngine(rewriting, lambda t, k: []), rewriting, EnvSpec(CalcEnv),
                      EpisodeSettings(segments="whole"))
    assert "\n" not in str(err.value) and "per_turn" in str(err.value)
    assert not EpisodeRunner(ScriptedEngine(tok, lambda t, k: []), tok, EnvSpec(CalcEnv)).per_turn


def test_a_rewriting_template_falls_back_to_one_segment_per_turn_with_the_prompt_the_engine_saw(caplog):
    rewriting = rewriting_tokenizer()
    turns = [said(rewriting, "<think>12 threes</think>" + call("12*3")), said(rewriting, "<think>so</think>36")]
    engine = ScriptedEngine(rewriting, lambda t, k: turns[t])
    with caplog.at_level("WARNING", logger="grpokit.rollout"):
        runner = EpisodeRunner(engine, rewriting, EnvSpec(CalcEnv))          # auto
    assert runner.per_turn and "own segment" in caplog.text
    out = runner.run([{"prompt": "What is 12*3?", "answer": 36}], SamplingParams(n=1, max_new_tokens=400))
    rec = out.episodes[0]
    assert rec["stop_reason"] == "stop" and rec["turns"] == 2 and rec["env"].calls == ["12*3"]
    segs = rec["segments"]
    assert [ids for _, ids, _ in segs] == turns                       # the engine's ids, as sampled
    assert [lp for _, _, lp in segs] == [pytest.approx([-0.01] * len(turns[0])), pytest.approx([-0.02] * len(turns[1]))]
    # each turn's prompt is the template's own rendering of the conversation so far, which is what
    # the engine was given, and the second one no longer holds the first turn's reasoning
    chat = runner.chat
    assert [p for p, _, _ in segs] == [engine.calls[0][0][0], engine.calls[1][0][0]]
    assert segs[1][0] == chat.encode(chat.render(rec["messages"][:3], True))
    assert "12 threes" not in rewriting.decode(segs[1][0]) and "12 threes" in rewriting.decode(out.completion_ids[0])
    # the episode's row still shows the whole episode, its sampled tokens marked
    row = out.completion_ids[0][out.action_mask[0].bool()].tolist()
    assert row == turns[0] + turns[1]


def test_tools_reach_a_template_without_tool_support_through_the_system_message(tok):
    chat = ChatTokens(tok, EnvSpec(CalcEnv).schemas)
    assert not chat.native_tools
    text = chat.render([{"role": "user", "content": "hi"}], True)
    assert text.startswith("<|im_start|>system\nYou can use these tools") and '"name": "calculator"' in text


# ------------------------------------------------------------------------------- limits and faults

def test_max_turns_and_the_token_budget_end_episodes_with_their_reason(tok):
    loop = said(tok, call("1+1"))
    out, _, _ = run(tok, CalcEnv, lambda t, k: loop, n=1, max_turns=3)
    assert out.episodes[0]["stop_reason"] == "max_turns" and out.episodes[0]["turns"] == 3
    assert out.finish_reason == ["length"]
    # the budget counts every turn and observation; the turn that reaches it is cut there
    out, engine, _ = run(tok, CalcEnv, lambda t, k: loop, n=1, budget=150)
    e = out.episodes[0]
    assert e["stop_reason"] == "length" and int(out.completion_mask.sum()) == 150
    # each turn was allowed only what remained of the budget
    for prompts, _, allowed in engine.calls:
        used = len(prompts[0]) - len(out.prompt_ids[0])
        assert allowed == 150 - used
    assert len(engine.calls) >= 2


def test_failing_slow_unknown_and_unparsable_tool_calls_become_observations(tok):
    script = [said(tok, call("boom")), said(tok, call("slow")),
              said(tok, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'),
              said(tok, "<tool_call>{oops</tool_call>"), said(tok, "done")]
    t0 = time.monotonic()
    out, _, _ = run(tok, CalcEnv, lambda t, k: script[t], n=1, budget=1200, tool_timeout_s=0.5)
    assert time.monotonic() - t0 < 4                       # the slow tool did not hold the episode
    e = out.episodes[0]
    assert e["stop_reason"] == "stop" and e["turns"] == 5 and e["final"] == "done"
    assert e["tool_calls"] == 3 and e["tool_errors"] == 3 and e["parse_failures"] == 1
    said_back = [m["content"] for m in e["messages"] if m["role"] != "assistant"][1:]
    assert "ValueError: cannot evaluate boom" in said_back[0]
    assert "did not answer within 0.5 s" in said_back[1]
    assert "no tool 'nope'" in said_back[2] and "Could not read the tool call" in said_back[3]


def test_long_observations_are_cut_in_the_middle(tok):
    out, _, _ = run(tok, EnvSpec(tools=[shout]), lambda t, k: said(tok, '<tool_call>{"name": "shout", "arguments": '
                    '{"text": "' + "ab" * 100 + '"}}</tool_call>') if t == 0 else said(tok, "ok"), n=1,
                    max_observation_tokens=40)
    obs = out.episodes[0]["messages"][2]["content"]
    assert obs.startswith("ABAB") and obs.endswith("ABAB") and "tokens cut" in obs and len(obs) < 100


def test_a_text_environment_answers_each_turn_until_it_ends_the_episode(tok):
    guesses = ["3", "8", "5"]
    out, _, _ = run(tok, GuessEnv, lambda t, k: said(tok, guesses[t]), rows=[{"prompt": "x", "answer": 5}], n=1)
    e = out.episodes[0]
    assert e["stop_reason"] == "stop" and e["turns"] == 3
    assert [m["content"] for m in e["messages"] if m["role"] == "user"] == [
        "Guess my number between 0 and 9 (try x).", "higher", "lower"]


ALTERNATING = ("{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
               "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
               "{{ raise_exception('roles must alternate') }}{% endif %}"
               "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_without_a_tool_role_gets_one_user_message_per_turn(tok):
    strict = build_chat_tokenizer(CHARS)
    strict.chat_template = ALTERNATING.replace("{% continue %}", "{{ raise_exception('no tool role') }}")
    dropping = build_chat_tokenizer(CHARS)          # renders no tool messages (and has a "y" in its text)
    dropping.chat_template = "{# by you #}" + ALTERNATING
    for t in (strict, dropping):
        assert ChatTokens(t, EnvSpec(CalcEnv).schemas).tool_role == "user"
    two = said(strict, call("2*3") + call("4*5"))
    out, _, _ = run(strict, CalcEnv, lambda t, k: two if t == 0 else said(strict, "6 and 20"), n=1)
    e = out.episodes[0]
    assert e["stop_reason"] == "stop" and e["tool_calls"] == 2
    user = e["messages"][2]
    assert user["role"] == "user" and "6" in user["content"] and "20" in user["content"]
    assert e["messages"][3]["role"] == "assistant"


def test_tool_timeouts_do_not_add_up_and_a_hung_tool_does_not_hold_the_process(tok, tmp_path):
    import subprocess
    import sys

    t0 = time.monotonic()
    out, _, runner = run(tok, CalcEnv, lambda t, k: said(tok, call("slow")) if t == 0 else said(tok, "x"),
                         rows=[{"prompt": f"q{i}", "answer": 1} for i in range(4)], n=2, tool_timeout_s=0.5,
                         tool_workers=2)
    assert time.monotonic() - t0 < 4.5                     # 8 slow calls, 2 workers: not 8 x 0.5 s one after another
    assert all(e["tool_timeouts"] == 1 and e["stop_reason"] == "stop" for e in out.episodes)
    script = ("import time; from grpokit.rollout.episodes import ToolPool\n"
              "p = ToolPool(2, 0.2)\n"
              "print(p.run([[('tool never', lambda: time.sleep(10**6))]]))\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and "did not answer within 0.2 s" in done.stdout
    assert time.monotonic() - t0 < 60


def test_a_pool_whose_calls_hang_gives_their_slots_back():
    from grpokit.rollout.episodes import ToolPool

    pool = ToolPool(1, 0.2)
    first = pool.run([[("tool hang", lambda: time.sleep(30))]])
    assert first[0][0][1] == "timeout" and pool.hung == 1
    again = pool.run([[("tool quick", lambda: "ok")]])      # runs although the hung call still holds its thread
    assert again == [[("ok", None)]]


def test_per_episode_scheduling_generates_an_episode_s_next_turn_while_another_s_tool_runs(tok):
    """Episode 0's first tool answers only once episode 1 has been given its third turn: with
    per-episode scheduling episode 1 plays on beside the waiting tool, and every episode ends as
    it does with batched turns (the scripted engine answers by turn alone)."""
    import threading

    third = threading.Event()

    class Waiting(CalcEnv):
        def reset(self, **row):
            self.waits = row["prompt"] == "waits"
            return super().reset(**row)

        def calculator(self, expression: str) -> str:
            """Evaluate an arithmetic expression.

            Args:
                expression: digits and + - *
            """
            if self.waits and not self.calls:
                assert third.wait(30), "episode 1 did not get its third turn while this tool ran"
            return super().calculator(expression)

    turns = [said(tok, call("1+1")), said(tok, call("2+2")), said(tok, "done")]
    rows = [{"prompt": "waits", "answer": 1}, {"prompt": "plays", "answer": 1}]

    def script(t, k):
        if t == 2:
            third.set()
        return turns[t]

    out, engine, _ = run(tok, Waiting, script, rows=rows, n=1, scheduling="per_episode", tool_timeout_s=60)
    assert [e["stop_reason"] for e in out.episodes] == ["stop", "stop"]
    assert [e["tool_timeouts"] for e in out.episodes] == [0, 0]
    widths = [len(c[0]) for c in engine.calls]
    assert widths[0] == 2 and 1 in widths[1:]                  # later calls went without the waiting episode
    third.clear()
    batched, _, _ = run(tok, CalcEnv, script, rows=rows, n=1)
    assert torch.equal(out.completion_ids, batched.completion_ids)
    assert torch.equal(out.action_mask, batched.action_mask)
    assert [e["messages"] for e in out.episodes] == [e["messages"] for e in batched.episodes]
    assert out.timing["engine_calls"] > batched.timing["engine_calls"] == 3


def test_per_episode_scheduling_records_failures_as_batched_turns_do(tok):
    """Hung, raising, unknown and unparsable calls in per-episode scheduling: the same observations
    and stop reasons as batched turns, and a hung call costs its own episode its timeout only."""
    scripts = [call("slow"), call("boom"), '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
               "<tool_call>not json</tool_call>", call("3*4")]
    rows = [{"prompt": f"q{i}", "answer": 1} for i in range(len(scripts))]

    def play(mode):
        runner = EpisodeRunner(_PerRow(tok, scripts), tok, EnvSpec(CalcEnv),
                               EpisodeSettings(scheduling=mode, tool_timeout_s=0.5, tool_workers=2))
        return runner.run(rows, SamplingParams(n=1, max_new_tokens=400))

    per, batched = play("per_episode"), play("batched")
    assert [e["messages"] for e in per.episodes] == [e["messages"] for e in batched.episodes]
    assert [e["stop_reason"] for e in per.episodes] == ["stop"] * 5
    assert [(e["tool_errors"], e["tool_timeouts"], e["parse_failures"]) for e in per.episodes] == \
        [(1, 1, 0), (1, 0, 0), (1, 0, 0), (0, 0, 1), (0, 0, 0)]
    assert per.episodes[4]["time_env"] < 0.4 < per.episodes[0]["time_env"]
    with pytest.raises(ConfigError, match="scheduling"):
        EpisodeRunner(_PerRow(tok, scripts), tok, EnvSpec(CalcEnv), EpisodeSettings(scheduling="eager"))


class _PerRow(ScriptedEngine):
    """The first turn of row i says `scripts[i]`; every later turn says "end"."""

    def __init__(self, tokenizer, scripts):
        super().__init__(tokenizer, None)
        self.scripts = scripts

    def generate(self, prompt_ids, params, generator=None):
        texts = [self.tok.decode(p) for p in prompt_ids]
        answers = [said(self.tok, "end") if t.count("<|im_start|>assistant") > 1
                   else said(self.tok, self.scripts[int(t.split("q")[-1][0])]) for t in texts]
        it = iter(answers)
        self.script = lambda turn, k: next(it)
        return super().generate(prompt_ids, params, generator)
