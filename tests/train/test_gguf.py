"""GGUF loading: conversion into a plain directory, its content-keyed cache, atomic writes, errors.

A tiny Llama GGUF file (tests/train/tiny_gguf.py) is converted and compared with what transformers
reads from the same file directly, an independent path through the `gguf` package."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf); the GGUF loader needs it")

from grpokit.cli import main as cli_main  # noqa: E402
from grpokit.config import load_config  # noqa: E402
from grpokit.models import gguf, load_model, load_tokenizer  # noqa: E402
from grpokit.models.hf import ModelLoadError  # noqa: E402
from grpokit.train import build_trainer  # noqa: E402
from tests.train.tiny_gguf import write_tiny_gguf  # noqa: E402


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(gguf.CACHE_ENV, str(root))
    return root / "gguf"


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q.gguf")


def _direct(path: Path):
    """The model and tokenizer as transformers loads them from the GGUF file itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tok


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_conversion_is_cached_by_content_and_matches_the_file(tiny_file, cache, tmp_path, monkeypatch):
    out = gguf.resolve_model_dir(tiny_file)
    assert out == cache / hashlib.sha256(tiny_file.read_bytes()).hexdigest()[:16]
    # the plain directory holds no trace of quantization, and loads like any other
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert json.loads((out / gguf.PROVENANCE).read_text())["sha256"] == hashlib.sha256(tiny_file.read_bytes()).hexdigest()
    model, tok = load_model(tiny_file, device="cpu"), load_tokenizer(tiny_file)
    ref_model, ref_tok = _direct(tiny_file)
    msgs = [{"role": "user", "content": "the cat in the hat"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ref_tok(text, add_special_tokens=False)["input_ids"]
    assert torch.equal(_logits(model, ids), _logits(ref_model, ids))

    # later loads reuse the directory: a conversion now would fail loudly
    def no_conversion(src, dst):
        raise AssertionError("converted again")
    monkeypatch.setattr(gguf, "_write_converted", no_conversion)
    assert gguf.resolve_model_dir(tiny_file) == out
    renamed = tmp_path / "renamed.gguf"                       # same content under another name
    shutil.copy(tiny_file, renamed)
    assert gguf.resolve_model_dir(renamed) == out
    assert gguf.resolve_model_dir(tmp_path, gguf_file="renamed.gguf") == out
    assert [p.name for p in cache.iterdir()] == [out.name]


def test_a_different_file_gets_its_own_directory(tiny_file, cache, tmp_path):
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)
    a, b = gguf.resolve_model_dir(tiny_file), gguf.resolve_model_dir(other)
    assert a != b
    ids = [5, 6, 7, 8]
    assert not torch.equal(_logits(load_model(a, device="cpu"), ids), _logits(load_model(b, device="cpu"), ids))


def test_an_interrupted_conversion_leaves_no_directory(tiny_file, cache, monkeypatch):
    real = gguf._write_converted

    def interrupted(src, dst):
        real(src, dst)                          # everything written, then the rename never happens
        raise KeyboardInterrupt
    monkeypatch.setattr(gguf, "_write_converted", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf.resolve_model_dir(tiny_file)
    assert not cache.exists() or list(cache.iterdir()) == []
    monkeypatch.setattr(gguf, "_write_converted", real)
    assert (gguf.resolve_model_dir(tiny_file) / "model.safetensors").is_file()


def test_memory_planning_reads_the_shape_of_a_gguf_file(tiny_file, cache):
    from grpokit.train.memory import load_shape

    shape = load_shape(str(tiny_file))
    assert (shape.model_type, shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.tied) == ("llama", 32, 2, 4, 2, True)
    assert shape.vocab == len(load_tokenizer(tiny_file))


def test_plain_directories_pass_through(tmp_path):
    assert gguf.resolve_model_dir(tmp_path) == tmp_path
    assert gguf.resolve_model_dir("") == ""


@pytest.mark.parametrize("case, message", [
    ("missing", "GGUF file not found"),
    ("not_gguf", "not a GGUF file"),
    ("absolute_name", "must be a file name inside model.path"),
    ("name_without_dir", "not a directory"),
    ("no_package", "pip install"),
])
def test_bad_gguf_inputs_are_one_line_errors(case, message, tmp_path, tiny_file, cache, monkeypatch):
    fake = tmp_path / "weights.gguf"
    fake.write_text("not a gguf file")
    args = {"missing": (tmp_path / "nope.gguf", ""), "not_gguf": (fake, ""),
            "absolute_name": (tmp_path, str(tiny_file)), "name_without_dir": (tiny_file, "tiny.gguf"),
            "no_package": (tiny_file, "")}[case]
    if case == "no_package":
        monkeypatch.setitem(__import__("sys").modules, "gguf", None)     # as if it were not installed
    with pytest.raises(ModelLoadError, match=message) as err:
        load_tokenizer(args[0], gguf_file=args[1])
    assert "\n" not in str(err.value)


def test_convert_command(tiny_file, tmp_path, capsys):
    out = tmp_path / "plain"
    assert cli_main(["convert", str(tiny_file), str(out)]) == 0
    ref_model, _ = _direct(tiny_file)
    assert torch.equal(_logits(load_model(out, device="cpu"), [3, 4, 5]), _logits(ref_model, [3, 4, 5]))
    not_gguf = tmp_path / "x.txt"
    not_gguf.write_text("hello")
    for argv, why in [([str(tmp_path / "missing.gguf"), str(tmp_path / "o1")], "not found"),
                      ([str(not_gguf), str(tmp_path / "o2")], "not a GGUF file"),
                      ([str(tiny_file), str(out)], "not an empty directory")]:
        capsys.readouterr()
        assert cli_main(["convert", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert why in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_a_run_from_a_gguf_file_saves_plain_checkpoints(tiny_file, cache, tmp_path):
    from transformers import AutoModelForCausalLM

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"the {i} cat"}], "answer": str(i)}) + "\n"
                             for i in range(8)))
    over = {"model.path": tiny_file, "data.path": train, "train.run_dir": tmp_path / "run", "rollout.group_size": 4,
            "rollout.batch_size": 8, "rollout.max_new_tokens": 4, "rollout.temperature": 1.0, "optim.lr": 1e-2,
            "train.steps": 1, "train.progress": False, "monitor.sinks": "[jsonl]", "train.sample_every": 0,
            "train.batch_advice": False, "train.check_rewards": False, "algorithm.kl.beta": 0.0,
            "rewards": "[{name: test_text_length}]"}
    import tests.fixtures  # noqa: F401  (registers test_text_length)
    trainer = build_trainer(load_config(None, [f"{k}={v}" for k, v in over.items()]), health=False)
    trainer.train()
    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    policy_dir = next(p.parent for p in ckpt.rglob("config.json"))
    loaded = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    ids = [5, 6, 7, 8]
    assert torch.equal(_logits(loaded, ids), _logits(trainer.model.eval(), ids))
    assert not torch.equal(_logits(loaded, ids), _logits(load_model(tiny_file, device="cpu"), ids))   # it trained


def test_a_foreign_directory_in_the_cache_is_a_one_line_error(tiny_file, cache):
    squatter = cache / hashlib.sha256(tiny_file.read_bytes()).hexdigest()[:16]
    squatter.mkdir(parents=True)
    (squatter / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError, match="in the way"):
        gguf.resolve_model_dir(tiny_file)
    assert [p.name for p in cache.iterdir()] == [squatter.name]          # no partial left beside it
