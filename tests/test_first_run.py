"""A new user's first-run mistakes are caught before the first step: each is one line on stderr,
naming the thing, with exit status 2 from the real CLI (or a ConfigError from the Python API), and
none reaches the model loading when it need not (the model path is often left wrong on purpose: a
check that came too late would report the model instead)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpokit.cli import main
from grpokit.config import load_config
from grpokit.errors import ConfigError
from grpokit.rewards import REGISTRY
from tests.fixtures import tiny_model_dir

NO_MODEL = "/nonexistent/first-run-model"


def _rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("first_run")
    return {
        "root": root,
        "model": tiny_model_dir(root / "model"),
        "train": _rows(root / "train.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]),
        "no_answer": _rows(root / "no_answer.jsonl", [{"prompt": f"{i}+1="} for i in range(8)]),
        "solution": _rows(root / "solution.jsonl", [{"question": f"{i}+1=", "solution": str(i + 1)} for i in range(8)]),
        "empty": _rows(root / "empty.jsonl", []),
        "long": _rows(root / "long.jsonl", [{"prompt": "1+" * 40 + "1=", "answer": "41"}]),
    }


@pytest.fixture(autouse=True)
def _registry_as_before():
    before = dict(REGISTRY)
    yield
    REGISTRY.clear()
    REGISTRY.update(before)


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of `grpokit argv`; a traceback fails the test by propagating."""
    rc = main(argv)
    return rc, capsys.readouterr().err.strip()


def _one_line_error(rc: int, err: str, *fragments: str) -> None:
    assert rc == 2, err
    assert err.startswith("error: ") and "\n" not in err, err
    for f in fragments:
        assert f in err, (f, err)


def _train(files, *overrides: str, model: str | None = None) -> list[str]:
    return ["train", "grpo", f"model.path={model or NO_MODEL}", f"data.path={files['train']}",
            f"train.run_dir={files['root'] / 'run'}", "rollout.group_size=4", "rollout.batch_size=8",
            "rollout.max_new_tokens=4", "train.steps=1", "train.progress=false", "monitor.sinks=[jsonl]",
            *overrides]


# ------------------------------------------------------------------------ registry names


NAMES = [
    ("algorithm.advantage=grop", "unknown advantage estimator 'grop'; did you mean 'grpo'?"),
    ("algorithm.loss_agg=token_men", "unknown loss aggregation 'token_men'; did you mean 'token_mean'?"),
    ("algorithm.kl.estimator=k33", "unknown KL estimator 'k33'"),
    ("algorithm.kl.controller=adaptve", "unknown KL controller 'adaptve'; did you mean 'adaptive'?"),
    ("rollout.engine=hf_cpy", "unknown rollout engine 'hf_cpy'; did you mean 'hf_copy'?"),
    ("rewards=[{name: math_acuracy}]", "unknown reward 'math_acuracy'; did you mean 'math_accuracy'?"),
    ("monitor.sinks=[jsonl,tensorbord]", "unknown sink 'tensorbord' (did you mean 'tensorboard'?)"),
    ("crosscheck={primary: math_accuracy, checker: math_accuracy_al}", "did you mean 'math_accuracy_alt'?"),
    ("rewards=[{name: math_accuracy}, {name: length_group, args: {verifier: exact_mach}}]",
     "unknown reward 'exact_mach'; did you mean 'exact_match'?"),
    ("rewards=[{name: exact_match, args: {answer_colum: x}}]",
     "reward 'exact_match' has no argument 'answer_colum'; did you mean 'answer_column'?"),
]


@pytest.mark.parametrize("override, fragment", NAMES)
def test_a_wrong_name_stops_the_cli_at_config_build(files, capsys, override, fragment):
    _one_line_error(*_run(capsys, _train(files, override)), fragment)


@pytest.mark.parametrize("override, fragment", NAMES[:7])
def test_a_wrong_name_in_a_yaml_file_and_from_the_api(files, capsys, tmp_path, override, fragment):
    key, value = override.split("=", 1)
    *sections, leaf = key.split(".")
    text = "".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(sections)) + f"{'  ' * len(sections)}{leaf}: {value}\n"
    cfg = tmp_path / "mine.yaml"
    cfg.write_text("base: grpo\n" + text)
    _one_line_error(*_run(capsys, ["train", str(cfg), f"model.path={NO_MODEL}"]), fragment)

    import yaml

    from grpokit import GRPO
    data = yaml.safe_load(text)
    with pytest.raises(ConfigError, match="did you mean|unknown") as err:
        GRPO(model=NO_MODEL, dataset=str(files["train"]), config=data)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_misspelled_preset_and_a_missing_config_file(files, capsys):
    _one_line_error(*_run(capsys, ["train", "grpoo", f"model.path={NO_MODEL}"]), "did you mean preset 'grpo'?")
    missing = files["root"] / "nope.yaml"
    _one_line_error(*_run(capsys, ["train", str(missing)]), f"config file not found: {missing}")


# ------------------------------------------------------------------------ dataset columns


def test_a_dataset_without_the_answer_column_is_refused_before_the_model_loads(files, capsys):
    rc, err = _run(capsys, _train(files, f"data.path={files['no_answer']}", "rewards=[{name: math_accuracy}]"))
    _one_line_error(rc, err, "reward 'math_accuracy' needs the column 'answer'", str(files["no_answer"]),
                    "its columns: prompt", "data.answer_field")


def test_the_column_check_follows_renaming_and_reward_args(files, capsys):
    # data.answer_field / prompt_field rename the columns first: then nothing is missing
    cfg = load_config("grpo", [f"data.path={files['solution']}", "data.answer_field=solution",
                               "data.prompt_field=question", "rewards=[{name: exact_match}]"])
    from grpokit.train import load_datasets

    ds, _ = load_datasets(cfg)
    assert ds.rows[0] == {"prompt": "0+1=", "answer": "1"}
    # a reward told to read another column needs that one
    rc, err = _run(capsys, _train(files, "rewards=[{name: exact_match, args: {answer_column: gold}}]"))
    _one_line_error(rc, err, "reward 'exact_match' needs the column 'gold'", "its columns: answer, prompt")
    rc, err = _run(capsys, _train(files, "rewards=[{name: code_tests}]"))
    _one_line_error(rc, err, "reward 'code_tests' needs the column 'tests'")
    # length_group reads what its verifier reads
    rc, err = _run(capsys, _train(files, f"data.path={files['no_answer']}",
                                  "rewards=[{name: length_group, args: {verifier: numeric_match}}]"))
    _one_line_error(rc, err, "reward 'length_group' needs the column 'answer'")


def test_the_held_out_set_and_grpokit_eval_are_checked_too(files, capsys):
    rc, err = _run(capsys, _train(files, f"data.eval_path={files['no_answer']}"))
    _one_line_error(rc, err, "needs the column 'answer'", str(files["no_answer"]))
    rc, err = _run(capsys, ["eval", "--model", NO_MODEL, "--data", str(files["no_answer"])])
    _one_line_error(rc, err, "reward 'math_accuracy' needs the column 'answer'")


def test_the_api_checks_registered_rewards_and_user_functions(files):
    from grpokit import GRPO

    with pytest.raises(ConfigError, match="reward 'numeric_match' needs the column 'answer'"):
        GRPO(model=NO_MODEL, rewards=["numeric_match"], dataset=[{"prompt": "1+1="}])

    def graded(prompts, completions, rubric, **columns):       # `rubric`: a column it cannot do without
        return [1.0] * len(completions)

    with pytest.raises(ConfigError, match="reward 'graded' needs the column 'rubric', which dataset does not have"):
        GRPO(model=NO_MODEL, rewards=[graded], dataset=[{"prompt": "1+1=", "answer": "2"}])
    with pytest.raises(ConfigError, match="eval_dataset"):
        GRPO(model=NO_MODEL, rewards=[graded], dataset=[{"prompt": "1+1=", "rubric": "x"}],
             eval_dataset=[{"prompt": "2+2="}])


def test_a_column_missing_from_some_rows_only_is_a_warning(files, tmp_path, caplog):
    from grpokit.rewards import check_columns

    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b"}, {"prompt": "c", "answer": None}]
    cfg = load_config("grpo", ["rewards=[{name: exact_match}]"])
    with caplog.at_level("WARNING", logger="grpokit.rewards"):
        check_columns(cfg.rewards, rows, "mine.jsonl")
    assert "column 'answer' is missing or null in 2 of 3 rows of mine.jsonl" in caplog.text


# ------------------------------------------------------------------------ wrong paths, empty targets


def test_every_entry_point_answers_a_wrong_path_with_one_line(files, capsys, tmp_path):
    f = files
    not_a_run = tmp_path / "not_a_run"
    not_a_run.mkdir()
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    (empty_run / "metrics.jsonl").write_text("")
    cases = [
        (_train(f, model=str(tmp_path / "no_model")), f"model directory not found: {tmp_path / 'no_model'}"),
        (_train(f, f"data.path={tmp_path / 'none.jsonl'}"), f"dataset not found: {tmp_path / 'none.jsonl'}"),
        (_train(f, f"data.path={f['empty']}"), f"{f['empty']}: the dataset is empty"),
        (_train(f, f"data.eval_path={f['empty']}"), f"{f['empty']}: the dataset is empty"),
        (["eval", "--model", str(f["root"]), "--data", str(f["train"])], "not a Hugging Face model directory"),
        (["eval", "--model", str(f["model"]), "--data", str(tmp_path / "x.jsonl")], "dataset not found"),
        (["eval", "--model", str(f["model"]), "--data", str(f["empty"])], "the dataset is empty"),
        (["report", str(tmp_path / "gone")], f"run directory not found: {tmp_path / 'gone'}"),
        (["report", str(not_a_run)], f"{not_a_run} is not a run directory: no metrics.jsonl"),
        (["report", str(empty_run)], "metrics.jsonl is empty"),
        (["report", str(f["train"])], "is a file; grpokit report takes a run directory"),
        (["plan-memory", "grpo", f"model.path={tmp_path / 'no_model'}"], "model directory not found"),
        (["plan-memory", "grpo", f"model.path={f['model']}", f"data.path={tmp_path / 'gone.jsonl'}"],
         "dataset not found"),
        (["demo", "--quick", "--run-dir", str(f["train"])], "is a file, not a directory"),
        (["compare", "grpoo", "--seeds", "0"], "did you mean preset 'grpo'?"),
    ]
    for argv, fragment in cases:
        _one_line_error(*_run(capsys, argv), fragment)
    assert not (not_a_run / "report.html").exists()


# ------------------------------------------------------------------------ --resume


def test_resume_with_nothing_to_resume_is_an_error_saying_how_to_start_fresh(files, capsys, tmp_path):
    run = tmp_path / "typo_run"
    rc, err = _run(capsys, _train(files, f"train.run_dir={run}") + ["--resume"])
    _one_line_error(rc, err, f"nothing to resume: {run} does not exist", "leave out --resume")
    run.mkdir()
    rc, err = _run(capsys, ["train", "grpo", "--resume", f"model.path={NO_MODEL}", f"train.run_dir={run}"])
    _one_line_error(rc, err, f"{run} holds no checkpoint and no earlier run")


def test_resume_true_from_python_with_nothing_to_resume(files, tmp_path):
    from grpokit import GRPO

    grpo = GRPO(model=str(files["model"]), rewards=["exact_match"], dataset=str(files["train"]), config="grpo",
                overrides={"train.run_dir": str(tmp_path / "fresh"), "rollout.group_size": 4,
                           "rollout.batch_size": 8, "rollout.max_new_tokens": 4, "train.progress": False,
                           "monitor.sinks": ["jsonl"]})
    with pytest.raises(ConfigError, match="resume=True: nothing to resume"):
        grpo.train(resume=True)
    assert not any((tmp_path / "fresh").iterdir())             # nothing started


# ------------------------------------------------------------------------ more mistakes of the kind


@pytest.mark.parametrize("override, fragment", [
    ("rollout.group_size=1", "rollout.group_size must be >= 2"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens must be > 0"),
    ("rollout.batch_size=0", "config key 'rollout.batch_size'"),
    ("optim.lr=-1e-6", "config key 'optim.lr'"),
    ("train.steps=ten", "config key 'train.steps'"),
    ("model.device=cdua", "unknown device 'cdua'; did you mean 'cuda'?"),
    ("trian.steps=3", "unknown config key 'trian'"),
    ("rollout.temprature=0.7", "did you mean 'rollout.temperature'?"),
])
def test_bad_values_and_keys(files, capsys, override, fragment):
    _one_line_error(*_run(capsys, _train(files, override)), fragment)


def test_prompts_the_model_cannot_take(files, capsys, tmp_path):
    model = str(files["model"])                                 # 64 positions, character tokens
    rc, err = _run(capsys, _train(files, f"data.path={files['long']}", model=model))
    _one_line_error(rc, err, f"{files['long']} row 1: a prompt of 82 tokens plus rollout.max_new_tokens 4 "
                             "exceeds the model's 64 positions")
    fits = _rows(tmp_path / "fits.jsonl", [{"prompt": "1+" * 25 + "1=", "answer": "26"}])   # 52 + 16 > 64
    rc, err = _run(capsys, _train(files, f"data.path={fits}", "rollout.max_new_tokens=16", model=model))
    _one_line_error(rc, err, "lower rollout.max_new_tokens to 12")
    rc, err = _run(capsys, _train(files, "data.chat_template=always", model=model))
    _one_line_error(rc, err, "data.chat_template=always, but the tokenizer has no chat template")
    rc, err = _run(capsys, _train(files, f"data.path={_rows(tmp_path / 'blank.jsonl', [{'prompt': ''}])}",
                                  "rewards=[{name: boxed_format}]", model=model))
    _one_line_error(rc, err, "row 1: the prompt is empty")


def test_flags_may_follow_overrides_and_counts_are_checked(files, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--model", str(files["model"]), "--data", str(files["train"]), "--samples", "-1"])
    assert exit_.value.code == 2 and "--samples: must be >= 0" in capsys.readouterr().err
