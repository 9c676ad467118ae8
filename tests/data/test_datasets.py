import json

import pytest

from grpokit.data.datasets import DataError, PromptSampler, load_prompts


def test_jsonl_with_field_map_and_extra_columns(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"question": "2+2=", "solution": 4, "tests": "assert True"}) + "\n\n")
    ds = load_prompts(p, prompt_field="question", answer_field="solution")
    assert ds.rows == [{"prompt": "2+2=", "answer": "4", "tests": "assert True"}]


def test_malformed_row_names_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: malformed JSON"):
        load_prompts(p)
    p.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: missing field 'prompt'"):
        load_prompts(p)
    p.write_text('{"prompt": 3}\n')
    with pytest.raises(DataError, match="must be a string or a list of chat messages"):
        load_prompts(p)


def test_empty_and_missing(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text("\n")
    with pytest.raises(DataError, match="empty"):
        load_prompts(p)
    with pytest.raises(DataError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="unsupported dataset format"):
        (tmp_path / "x.csv").write_text("a,b\n")
        load_prompts(tmp_path / "x.csv")


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+3="], "answer": ["2", "5"]}), p)
    assert [r["answer"] for r in load_prompts(p).rows] == ["2", "5"]


def test_saved_datasets_dir(tmp_path):
    datasets = pytest.importorskip("datasets")
    d = tmp_path / "ds"
    datasets.Dataset.from_dict({"prompt": ["1+1="], "answer": ["2"]}).save_to_disk(str(d))
    assert load_prompts(d).rows == [{"prompt": "1+1=", "answer": "2"}]


def test_sampler_is_resumable_and_covers_each_epoch():
    a = PromptSampler(10, seed=3)
    first = a.next(7)
    state = a.state_dict()
    rest = a.next(13)
    b = PromptSampler(10, seed=3)
    b.load_state_dict(state)
    assert b.next(13) == rest
    assert sorted(first + rest[:3]) == list(range(10))       # epoch 0 is a permutation
