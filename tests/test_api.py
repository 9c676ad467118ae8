"""`grpokit.GRPO`: the README's example run as written on the tiny model, inputs of every kind,
one-line errors for bad ones, and a global reward registry left as it was."""

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import grpokit
from grpokit.api import GRPO, _adapt, _config_data
from grpokit.config import Config, ConfigError, load_config
from grpokit.data.datasets import DataError
from grpokit.rewards import REGISTRY
from grpokit.rewards.registry import registered_while
from grpokit.rewards.checker import RENDERINGS
from grpokit.tasks.arithmetic import ArithmeticTask
from tests.fixtures import tiny_model_dir

README = Path(__file__).resolve().parents[1] / "README.md"
SMALL = {"rollout.group_size": 4, "rollout.batch_size": 16, "rollout.max_new_tokens": 4,
         "rollout.temperature": 1.0, "optim.lr": 1e-3, "optim.micro_batch_size": 16, "train.steps": 2,
         "train.progress": False, "monitor.sinks": "jsonl", "train.sample_every": 0,
         "train.check_rewards": False}   # the start-of-run determinism check calls rewards too: counted here are training calls
HELD_OUT = 6                      # != the 16 completions of a step, to tell eval calls from training ones


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("api") / "my-qwen")


def _rows(n, seed=0):
    return ArithmeticTask(seed=seed, heldout=HELD_OUT).train_rows(n, seed)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    return blocks[0]


def test_the_readme_example_trains_and_its_reward_reaches_the_metrics(model_dir, tmp_path, monkeypatch):
    """The README's example, run as written in a folder holding `./my-qwen`, `prompts.jsonl` and
    `heldout.jsonl` (the tiny model and the arithmetic task), only smaller (SMALL overrides on top of
    its own). The custom reward is spied on: it must be called once per step on the step's 16
    completions and its last training scores must be what `reward/correct/mean` reports. Held-out
    prompts are scored by the independent checker (`eval.checker: auto` picks math_accuracy_alt
    for these numeric answers), spied on too: its greedy scores are what `eval/pass@1` reports, and
    the training reward never scores a held-out completion."""
    import shutil

    shutil.copytree(model_dir, tmp_path / "my-qwen")
    _write_jsonl(tmp_path / "prompts.jsonl", _rows(64))
    _write_jsonl(tmp_path / "heldout.jsonl", ArithmeticTask(seed=0, heldout=HELD_OUT).heldout_rows())
    monkeypatch.chdir(tmp_path)
    calls: list[list] = []
    texts: list[list] = []          # the completions of each call

    def spy(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls.append(list(out))
            texts.append(list(args[1] if len(args) > 1 else kwargs["completions"]))
            return out
        return wrapped

    def small_grpo(*args, rewards, overrides=None, **kwargs):
        rewards = [spy(r) if callable(r) else r for r in rewards]
        return GRPO(*args, rewards=rewards, overrides={**(overrides or {}), **SMALL}, **kwargs)

    monkeypatch.setattr(grpokit, "GRPO", small_grpo, raising=False)
    checked: list[list] = []
    alt = REGISTRY["math_accuracy_alt"]

    @functools.wraps(alt)
    def spied_alt(*args, **kwargs):
        out = alt(*args, **kwargs)
        checked.append(list(out))
        return out
    monkeypatch.setitem(REGISTRY, "math_accuracy_alt", spied_alt)
    ns: dict = {}
    exec(compile(_readme_example(), "README.md", "exec"), ns)  # noqa: S102 - our own README

    grpo, metrics, held_out = ns["grpo"], ns["metrics"], ns["held_out"]
    assert grpo.reward_names == ["correct", "numeric_match"]
    assert grpo.trainer.step_idx == 2
    steps = [c for c in calls if len(c) == 16]
    assert len(steps) == 2                                           # called at each step
    scored = [s for s in steps[-1] if s is not None]
    assert metrics["reward/correct/mean"] == pytest.approx(sum(scored) / len(scored))
    assert "reward/numeric_match/mean" in metrics and "loss/policy" in metrics
    # the training reward scores no held-out completion: its calls on the held-out rows are the
    # checker's start-up probe, on the reference answers written bare, boxed and in a sentence
    answers = [r["answer"] for r in ArithmeticTask(seed=0, heldout=HELD_OUT).heldout_rows()]
    probes = [[form.format(a=a) for a in answers] for form in RENDERINGS]
    assert [t for t in texts if len(t) == HELD_OUT] == probes
    greedy = [c for c in checked if len(c) == HELD_OUT][-1]          # evaluate()'s greedy pass
    assert held_out["eval/pass@1"] == pytest.approx(sum(s == 1.0 for s in greedy) / HELD_OUT)
    assert "correct" not in REGISTRY                                 # registered only while building
    saved = yaml.safe_load((tmp_path / "runs" / "grpo" / "config.yaml").read_text())   # the run's record
    assert [r["name"] for r in saved["rewards"]] == ["correct", "numeric_match"]
    assert saved["rollout"]["group_size"] == 4 and saved["data"]["path"] == "prompts.jsonl"


def test_loaded_model_rows_and_evaluate_on_a_given_dataset(model_dir, tmp_path):
    """A loaded model (its tokenizer found in its directory), rows in memory, a grpokit-style
    positional reward and a Config object with overrides on top; 32 prompts are too few to carve a
    held-out split from, and a held-out set given to `evaluate` later is scored by the checker the
    config names: here the training reward itself, a function registered only while the run was built."""
    from grpokit.models.hf import load_model

    model = load_model(model_dir, dtype="float32", device="cpu")
    seen = []

    def digits(p, c, answer):                      # positional: (prompts, completions, column)
        seen.append([float(sum(ch.isdigit() for ch in x) % 3) for x in c])
        return seen[-1]

    cfg = load_config("grpo", ["algorithm.kl.beta=0"])
    grpo = GRPO(model=model, rewards=[(digits, 2.0)], dataset=_rows(32), config=cfg,
                overrides={**SMALL, "train.steps": 1, "train.run_dir": str(tmp_path / "run"), "eval.checker": "digits"})
    assert grpo.config.algorithm.kl.beta == 0 and grpo.config.rewards[0].weight == 2.0
    assert grpo.config.model.path == str(model_dir)
    assert grpo.trainer.model is model
    with pytest.raises(ConfigError, match="no held-out prompts"):
        grpo.evaluate()
    m = grpo.train()
    assert [len(c) for c in seen] == [16] and any(seen[0])         # one step; varied scores
    assert m["reward/digits/mean"] == pytest.approx(sum(seen[0]) / 16)
    assert m["reward/mean"] == pytest.approx(2 * sum(seen[0]) / 16)   # weighted by 2 in the total
    res = grpo.evaluate(ArithmeticTask(seed=0, heldout=HELD_OUT).heldout_rows())
    assert set(res) == {"eval/pass@1"} and len(seen[-1]) == HELD_OUT
    assert "digits" not in REGISTRY


# ----------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"rewards": [42]}, ConfigError, "rewards[0]: expected a reward function, a registered reward name"),
    ({"rewards": ["exact_mach"]}, ConfigError, "unknown reward 'exact_mach'; did you mean 'exact_match'?"),
    ({"rewards": [("exact_match", "heavy")]}, ConfigError, "weight of a (reward, weight) pair must be a number"),
    ({"dataset": [{"question": "1+1=", "answer": "2"}]}, DataError,
     "dataset row 1: missing field 'prompt' (fields: answer, question)"),
    ({"dataset": []}, DataError, "dataset: the dataset is empty"),
    ({"dataset": {"prompt": ["1+1="]}}, DataError, "dataset must be a list of rows"),
    ({"dataset": None}, DataError, "no prompts: pass dataset="),
    ({"rewards": [lambda completions, completion_ids, **kw: [1.0] * len(completions)]}, ConfigError,
     "reward 'reward' needs the column 'completion_ids', which dataset does not have"),
    ({"rewards": [lambda texts: texts]}, ConfigError, "must take (prompts, completions, **columns)"),
    ({"config": "grpoo"}, ConfigError, "did you mean preset 'grpo'?"),
    ({"overrides": {"rollout.groupsize": 8}}, ConfigError, "did you mean 'rollout.group_size'?"),
    ({"model": 3}, ConfigError, "model must be a model directory or a loaded transformers model"),
])
def test_bad_input_is_one_line_before_anything_loads(kwargs, error, fragment):
    before = dict(REGISTRY)
    args = {"model": "/nonexistent/model", "rewards": ["exact_match"], "dataset": [{"prompt": "1+1=", "answer": "2"}],
            **kwargs}
    with pytest.raises(error) as err:
        GRPO(**args)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert REGISTRY == before


def test_a_missing_model_directory_is_one_line():
    from grpokit.models.hf import ModelLoadError

    with pytest.raises(ModelLoadError, match="model directory not found"):
        GRPO(model="/nonexistent/model", rewards=["exact_match"], dataset=[{"prompt": "1+1=", "answer": "2"}])


# ----------------------------------------------------------------------- the pieces


def test_trl_and_grpokit_reward_signatures_are_both_called_right():
    cols = {"answer": ["2", "3"], "completion_length": [1, 1], "finish_reason": ["eos", "eos"]}

    def trl(completions, **kwargs):                         # TRL: keywords, prompts among kwargs
        assert kwargs["prompts"] == ["a", "b"] and kwargs["answer"] == ["2", "3"]
        return [float(c == a) for c, a in zip(completions, kwargs["answer"])]

    def named_only(completions, answer):                    # gets only what it names
        return [float(c == a) for c, a in zip(completions, answer)]

    def grpokit_style(p, c, **columns):                     # positional, any names
        assert p == ["a", "b"] and "finish_reason" in columns
        return [1.0, 1.0]

    for fn, want in ((trl, [1.0, 0.0]), (named_only, [1.0, 0.0]), (grpokit_style, [1.0, 1.0])):
        assert _adapt(fn)(["a", "b"], ["2", "4"], **cols) == want
    assert _adapt(named_only)._grpokit_caller.required == ["answer"]


def test_config_from_every_kind_of_source(tmp_path):
    yaml_file = tmp_path / "mine.yaml"
    yaml_file.write_text("base: dapo\ntrain:\n  steps: 7\n")
    assert _config_data(None) == {}
    assert _config_data("dr_grpo")["algorithm"]["advantage"] == "dr_grpo"
    assert _config_data(str(yaml_file))["train"]["steps"] == 7
    assert _config_data(["grpo", yaml_file])["algorithm"]["eps_high"] == 0.28
    user = {"train": {"steps": 3}}
    data = _config_data(user)
    data["train"]["steps"] = 4
    assert user == {"train": {"steps": 3}}                  # the caller's dict is not touched
    # a Config keeps only the fields that were set, so values derived from others stay derived
    assert _config_data(load_config(None, ["train.steps=3"])) == {"train": {"steps": 3}}
    with pytest.raises(ConfigError, match="config must be a Config, a dict"):
        _config_data(3)
    assert isinstance(Config.model_validate(_config_data("grpo")), Config)


def test_scoped_registration_keeps_names_apart_and_leaves_the_registry_as_it_was():
    def exact_match(prompts, completions, **columns):      # clashes with the built-in of that name
        return [1.0] * len(completions)

    def other(prompts, completions, **columns):
        return [0.0] * len(completions)

    before = dict(REGISTRY)
    with registered_while([("exact_match", exact_match), ("other", other), ("other", exact_match)]) as names:
        assert names == ["exact_match_2", "other", "other_2"]
        assert REGISTRY["other"] is other and REGISTRY["exact_match_2"] is exact_match
    assert REGISTRY == before
    with pytest.raises(RuntimeError), registered_while([("other", other)]):
        raise RuntimeError("a failed build")
    assert REGISTRY == before


def test_a_datasets_dataset_is_read_row_by_row():
    datasets = pytest.importorskip("datasets")
    g = GRPO.__new__(GRPO)
    g.config = Config()
    ds = g._prompts(datasets.Dataset.from_list([{"prompt": "1+1=", "answer": 2, "level": 1}]), "dataset")
    assert ds.rows == [{"prompt": "1+1=", "answer": "2", "level": 1}]
    with pytest.raises(DataError, match=r"a DatasetDict holds several splits \(train\)"):
        g._prompts(datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "x"}])}), "dataset")


def test_import_grpokit_stays_light():
    code = ("import sys, grpokit; assert 'GRPO' in dir(grpokit); cls = grpokit.GRPO; "
            "heavy = [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_the_cli_and_the_python_api_make_the_same_run(tmp_path):
    """One builder behind both faces: the same config from `grpokit train` and from `grpokit.GRPO`
    leaves the same files in its run directory (the report included) and logs the same metrics
    (times, throughput and memory aside)."""
    from grpokit.cli import main
    from tests.fixtures import small_overrides, tiny_run_inputs

    _, model_dir, train, held = tiny_run_inputs(tmp_path / "inputs")
    extra = {"rewards": "[{name: test_varied}]", "data.eval_path": held, "train.eval_every": 1,
             "train.save_every": 1, "train.sample_every": 1, "train.check_rewards": "false"}
    over = small_overrides(model_dir, train, tmp_path / "cli", **extra)
    assert main(["train", *over]) == 0
    api_over = dict(o.split("=", 1) for o in small_overrides(model_dir, train, tmp_path / "api", **extra))
    GRPO(config=load_config(None, [f"{k}={v}" for k, v in api_over.items()])).train()

    def files(root):
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    assert files(tmp_path / "cli") == files(tmp_path / "api")
    assert "report.html" in files(tmp_path / "api")

    def metrics(root):
        rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "throughput/", "memory/"))}
                for r in rows]

    cli, api = metrics(tmp_path / "cli"), metrics(tmp_path / "api")
    assert [r["step"] for r in cli] == [0, 1, 2] and "eval/pass@1" in cli[0] and "eval/pass@1" in cli[-1]
    for a, b in zip(cli, api):
        assert a.keys() == b.keys(), set(a) ^ set(b)
        assert {k: v for k, v in a.items() if v != b[k]} == {}
