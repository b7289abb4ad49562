"""PromptDataset: file and synthetic sources, order, resume, and the error for each bad input.

Expected token ids come from the tokenizer's vocabulary one character at a time (the tiny tokenizer
is character-level), not from the dataset code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_flash.config.schema import DataConfig
from megatron_flash.rollout.dataset import Prompt, PromptDataset


@pytest.fixture(scope="module")
def tokenizer():
    import transformers

    from tools.make_tiny_model import build_tokenizer

    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), pad_token="<pad>",
                                               bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}|{{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}assistant|{% endif %}")
    return tok


def char_ids(tokenizer, text: str) -> list[int]:
    vocab = tokenizer.get_vocab()
    return [vocab[c] for c in text]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def take(ds: PromptDataset, count: int) -> list[Prompt]:
    return [ds.next_prompt() for _ in range(count)]


ROWS = [
    {"question": "12+3=", "gold": 15, "level": "easy"},
    {"question": "what is ab", "gold": "ba", "level": "hard"},
    {"question": "7-2=", "gold": 5, "level": "easy"},
]


def check_rows(ds: PromptDataset, tokenizer) -> None:
    assert len(ds) == 3 and ds.num_skipped == 0
    got = take(ds, 3)
    assert [p.index for p in got] == [0, 1, 2]
    assert [p.text for p in got] == ["12+3=", "what is ab", "7-2="]
    assert [p.answer for p in got] == ["15", "ba", "5"]
    assert [p.meta for p in got] == [{"level": "easy"}, {"level": "hard"}, {"level": "easy"}]
    assert got[0].prompt_ids == char_ids(tokenizer, "12+3=")
    assert got[1].prompt_ids == char_ids(tokenizer, "what is ab")


def file_cfg(path: str, **kw) -> DataConfig:
    return DataConfig(path=path, prompt_key="question", answer_key="gold", shuffle=False, **kw)


def test_jsonl_file(tmp_path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    ds = PromptDataset.from_config(file_cfg(path), tokenizer, seed=0)
    check_rows(ds, tokenizer)
    assert ds.epoch == 1
    assert ds.next_prompt().index == 0  # endless: the next epoch starts over (no shuffle)


def test_json_array_and_parquet_files(tmp_path, tokenizer) -> None:
    json_path = tmp_path / "p.json"
    json_path.write_text(json.dumps(ROWS))
    check_rows(PromptDataset.from_config(file_cfg(str(json_path)), tokenizer, seed=0), tokenizer)

    import pandas as pd

    # A parquet column has one type: answers as strings (a JSON file may mix ints and strings).
    pq_path = str(tmp_path / "p.parquet")
    pd.DataFrame([{**r, "gold": str(r["gold"])} for r in ROWS]).to_parquet(pq_path)
    check_rows(PromptDataset.from_config(file_cfg(pq_path), tokenizer, seed=0), tokenizer)


def test_num_samples_and_max_prompt_len(tmp_path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ROWS + [{"question": "abcdefgh", "gold": "x", "level": "x"}])
    ds = PromptDataset.from_config(file_cfg(path, num_samples=2), tokenizer, seed=0)
    assert len(ds) == 2 and [p.index for p in take(ds, 3)] == [0, 1, 0]

    # lengths 5, 10, 4, 8 tokens; a limit of 5 keeps rows 0 and 2
    ds = PromptDataset.from_config(file_cfg(path, max_prompt_len=5), tokenizer, seed=0)
    assert len(ds) == 2 and ds.num_skipped == 2
    assert [p.index for p in take(ds, 2)] == [0, 2]


def test_prompts_that_cannot_fit_the_engines_are_dropped_at_load(tmp_path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ROWS + [{"question": "abcdefgh", "gold": "x", "level": "x"}])
    ds = PromptDataset.from_config(file_cfg(path), tokenizer, seed=0)
    # lengths 5, 10, 4, 8 tokens: an engine limit of 8 drops row 1 only
    assert ds.drop_longer_than(8, why="a test context") == 1 and ds.num_skipped == 1
    assert sorted(p.index for p in take(ds, 3)) == [0, 2, 3]
    with pytest.raises(ValueError, match=r"no prompt fits a test context: every one is longer than 3 tokens "
                                         r"\(e.g. row 4: 8 tokens\)"):
        ds.drop_longer_than(3, why="a test context")


def test_chat_template(tmp_path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    ds = PromptDataset.from_config(file_cfg(path, apply_chat_template=True), tokenizer, seed=0)
    prompt = ds.next_prompt()
    eos = tokenizer.get_vocab()["</s>"]
    assert prompt.text == "12+3="
    assert prompt.prompt_ids == char_ids(tokenizer, "user|12+3=") + [eos] + char_ids(tokenizer, "assistant|")


def test_synthetic_task(tokenizer) -> None:
    ds = PromptDataset.from_config(DataConfig(task="sort4", num_samples=40, shuffle=False), tokenizer, seed=7)
    items = take(ds, 40)
    assert len(ds) == 40 and [p.index for p in items] == list(range(40))
    for p in items:
        digits = p.text[:-1]
        assert p.text.endswith(":") and len(set(digits)) == 4 and digits.isdigit()
        assert p.answer == "".join(sorted(digits))
        assert p.prompt_ids == char_ids(tokenizer, p.text) and p.meta == {"task": "sort4"}
    again = take(PromptDataset.from_config(DataConfig(task="sort4", num_samples=40, shuffle=False),
                                           tokenizer, seed=7), 40)
    other = take(PromptDataset.from_config(DataConfig(task="sort4", num_samples=40, shuffle=False),
                                           tokenizer, seed=8), 40)
    assert [p.text for p in again] == [p.text for p in items]
    assert [p.text for p in other] != [p.text for p in items]
    assert len(PromptDataset.from_config(DataConfig(task="countdown"), tokenizer, seed=0)) == 1024


def order(seed: int, *, shuffle: bool, count: int, tokenizer) -> list[int]:
    ds = PromptDataset.from_config(DataConfig(task="reverse4", num_samples=30, shuffle=shuffle),
                                   tokenizer, seed=seed)
    return [p.index for p in take(ds, count)]


def test_shuffle_is_seeded_per_epoch(tokenizer) -> None:
    first = order(3, shuffle=True, count=90, tokenizer=tokenizer)
    epochs = [first[0:30], first[30:60], first[60:90]]
    for epoch in epochs:
        assert sorted(epoch) == list(range(30))  # each epoch visits every item once
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != list(range(30))
    assert order(3, shuffle=True, count=90, tokenizer=tokenizer) == first
    assert order(4, shuffle=True, count=30, tokenizer=tokenizer) != epochs[0]
    assert order(3, shuffle=False, count=60, tokenizer=tokenizer) == list(range(30)) * 2


def test_resume_continues_with_the_same_prompts(tokenizer) -> None:
    cfg = DataConfig(task="sort4", num_samples=30, shuffle=True)
    ds = PromptDataset.from_config(cfg, tokenizer, seed=11)
    take(ds, 47)
    state = ds.state_dict()
    assert state == {"epoch": 1, "position": 17} and ds.epoch == 1
    expected = [(p.index, p.text) for p in take(ds, 75)]  # crosses two more epoch boundaries

    resumed = PromptDataset.from_config(cfg, tokenizer, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    assert [(p.index, p.text) for p in take(resumed, 75)] == expected
    with pytest.raises(ValueError, match="30 prompts"):
        resumed.load_state_dict({"epoch": 0, "position": 30})


# ------------------------------------------------------------------------------------- bad input

def test_missing_file(tmp_path, tokenizer) -> None:
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError) as err:
        PromptDataset.from_config(file_cfg(missing), tokenizer, seed=0)
    assert missing in str(err.value) and "data.path" in str(err.value)


def test_neither_path_nor_task(tokenizer) -> None:
    with pytest.raises(ValueError) as err:
        PromptDataset.from_config(DataConfig(), tokenizer, seed=0)
    assert "data.path" in str(err.value) and "data.task" in str(err.value)


def test_unsupported_extension(tmp_path, tokenizer) -> None:
    path = tmp_path / "p.csv"
    path.write_text("question,gold\n1+1=,2\n")
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv'"):
        PromptDataset.from_config(file_cfg(str(path)), tokenizer, seed=0)


def test_row_missing_answer(tmp_path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [ROWS[0], {"question": "1+1=", "level": "easy"}, ROWS[2]])
    with pytest.raises(ValueError) as err:
        PromptDataset.from_config(file_cfg(path), tokenizer, seed=0)
    msg = str(err.value)
    assert path in msg and "row 2:" in msg and "'gold'" in msg and "data.answer_key" in msg


def test_prompt_column_absent(tmp_path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(ValueError) as err:
        PromptDataset.from_config(DataConfig(path=path, answer_key="gold"), tokenizer, seed=0)
    msg = str(err.value)
    assert path in msg and "row 1:" in msg and "'prompt'" in msg and "data.prompt_key" in msg


@pytest.mark.parametrize("bad, row", [("", 3), (17, 2)])
def test_empty_or_non_string_prompt(tmp_path, tokenizer, bad, row) -> None:
    rows = [dict(r) for r in ROWS]
    rows[row - 1]["question"] = bad
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError) as err:
        PromptDataset.from_config(file_cfg(path), tokenizer, seed=0)
    assert f"row {row}:" in str(err.value) and "non-empty string" in str(err.value)
