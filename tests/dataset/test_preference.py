"""Preference pairs (tier 1 / 2): every accepted row layout, errors naming the line and field,
tokenization of both sides on one prompt, and pairs built from sampled arithmetic answers."""

from __future__ import annotations

import json
import random

import pytest

from areal.api.config.data import ArithmeticConfig, DatasetConfig
from areal.dataset.arithmetic_pairs import ArithmeticPairsConfig, build_pairs, make_pairs
from areal.dataset.jsonl import DatasetError
from areal.dataset.preference import load_preference_jsonl, load_preferences, tokenize_pair

USER = {"role": "user", "content": "1 + 2 = ?"}


def _reply(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _write(tmp_path, rows: list) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


LAYOUTS = {
    "prompt + reply strings": {"prompt": "1 + 2 = ?", "chosen": "3", "rejected": "4"},
    "messages + reply strings": {"messages": [USER], "chosen": "3", "rejected": "4"},
    "whole conversations (HH as lists)": {
        "chosen": [USER, _reply("3")],
        "rejected": [USER, _reply("4")],
    },
    "ultrafeedback-binarized": {
        "prompt": "1 + 2 = ?",
        "chosen": [USER, _reply("3")],
        "rejected": [USER, _reply("4")],
        "messages": [USER, _reply("3")],
        "score_chosen": 9.0,
    },
    "reply-only lists + prompt": {
        "prompt": "1 + 2 = ?",
        "chosen": [_reply("3")],
        "rejected": [_reply("4")],
    },
    "raw HH transcripts": {
        "chosen": "\n\nHuman: 1 + 2 = ?\n\nAssistant: 3",
        "rejected": "\n\nHuman: 1 + 2 = ?\n\nAssistant: 4",
    },
}


@pytest.mark.parametrize("row", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_layout_gives_the_same_pair(tmp_path, row):
    (item,) = load_preference_jsonl(_write(tmp_path, [row]))
    assert (item["id"], item["messages"], item["chosen"], item["rejected"]) == (
        "pairs-1",
        [USER],
        "3",
        "4",
    )


def test_parquet_files_in_the_hf_layout_load_and_name_the_bad_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        LAYOUTS["whole conversations (HH as lists)"],
        {"chosen": [USER, _reply("3")], "rejected": [USER]},
    ]
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "good.parquet")
    (item,) = load_preference_jsonl(tmp_path / "good.parquet")
    assert (item["id"], item["messages"], item["chosen"], item["rejected"]) == (
        "good-1",
        [USER],
        "3",
        "4",
    )
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    with pytest.raises(
        DatasetError, match="bad.parquet:2: field 'rejected' must end with the assistant"
    ):
        load_preference_jsonl(tmp_path / "bad.parquet")


def test_multi_turn_conversations_keep_their_history_as_the_prompt(tmp_path):
    history = [USER, _reply("3"), {"role": "user", "content": "times 2?"}]
    (item,) = load_preference_jsonl(
        _write(
            tmp_path,
            [{"id": "a", "chosen": history + [_reply("6")], "rejected": history + [_reply("5")]}],
        )
    )
    assert (
        item["id"] == "a"
        and item["messages"] == history
        and (item["chosen"], item["rejected"]) == ("6", "5")
    )


BAD = [
    ({"prompt": "q", "rejected": "4"}, "pairs.jsonl:2: missing field 'chosen'"),
    (
        {"prompt": "q", "chosen": 3, "rejected": "4"},
        "pairs.jsonl:2: field 'chosen' must be a string or a list",
    ),
    (
        {"prompt": 5, "chosen": "3", "rejected": "4"},
        "pairs.jsonl:2: field 'prompt' must be a string",
    ),
    (
        {
            "chosen": [USER, _reply("3")],
            "rejected": [{"role": "user", "content": "2 + 2 = ?"}, _reply("4")],
        },
        "pairs.jsonl:2: fields 'chosen' and 'rejected' have different prompts",
    ),
    (
        {"chosen": [USER], "rejected": [USER, _reply("4")]},
        "pairs.jsonl:2: field 'chosen' must end with the assistant",
    ),
    (
        {"prompt": "other", "chosen": [USER, _reply("3")], "rejected": [USER, _reply("4")]},
        "pairs.jsonl:2: field 'prompt' differs from the last user message of 'chosen'",
    ),
    (
        {"chosen": "3", "rejected": "4"},
        "pairs.jsonl:2: field 'chosen' is a string but there is no 'prompt'",
    ),
    (
        {"chosen": [_reply("3")], "rejected": [_reply("4")]},
        "pairs.jsonl:2: field 'chosen' holds only the reply",
    ),
    (
        {"messages": [{"role": "user"}], "chosen": "3", "rejected": "4"},
        r"pairs.jsonl:2: field 'messages\[0\]'",
    ),
    ("[1, 2]", "pairs.jsonl:2: expected a JSON object"),
]


@pytest.mark.parametrize("row,message", BAD, ids=[m.split(": ", 1)[1][:40] for _, m in BAD])
def test_bad_rows_name_the_line_and_the_field(tmp_path, row, message):
    good = LAYOUTS["prompt + reply strings"]
    with pytest.raises(DatasetError, match=message):
        load_preference_jsonl(_write(tmp_path, [good, row]))


def test_both_sides_share_the_prompt_tokens_and_score_the_reply_and_end_of_turn(tiny_tokenizer):
    item = tokenize_pair(
        {"id": "x", "messages": [USER], "chosen": "3", "rejected": "14"}, tiny_tokenizer
    )
    p = item["prompt_len"]
    assert item["chosen_ids"][:p] == item["rejected_ids"][:p]
    assert tiny_tokenizer.decode(item["chosen_ids"][:p]).endswith("<|im_start|>assistant\n")
    assert tiny_tokenizer.decode(item["chosen_ids"][p:]) == "3<|im_end|>\n"
    assert tiny_tokenizer.decode(item["rejected_ids"][p:]) == "14<|im_end|>\n"


def test_builtin_arithmetic_pairs_and_jsonl_files_load_with_size_and_max_length(
    tmp_path, tiny_tokenizer
):
    arith = ArithmeticConfig(max_digits=1, operators="+", n_train=20, n_test=5, test_percent=20)
    data = load_preferences(
        DatasetConfig(type="rw", path="arithmetic", arithmetic=arith, size=7), tiny_tokenizer
    )
    assert len(data) == 7 and all(it["chosen"] != it["rejected"] for it in data)
    path = _write(
        tmp_path,
        [{"prompt": "q", "chosen": "3", "rejected": "4" * 40}, LAYOUTS["raw HH transcripts"]],
    )
    full = load_preferences(DatasetConfig(type="rw", path=path), tiny_tokenizer)
    short = load_preferences(DatasetConfig(type="rw", path=path, max_length=40), tiny_tokenizer)
    assert len(full) == 2 and [it["id"] for it in short] == [
        "pairs-2"
    ]  # the 40-digit reply is dropped
    with pytest.raises(DatasetError, match="need type 'rw', got 'sft'"):
        load_preferences(DatasetConfig(type="sft", path=path))


def test_pairs_put_a_right_answer_over_a_wrong_one():
    item = {"id": "arith-train-000001", "messages": [USER], "reference": "3"}
    rows = make_pairs(item, ["3", "4", "3", "5", "The answer is 3."], 5, random.Random(0))
    # right: {"3", "The answer is 3."}, wrong: {"4", "5"}: max(2, 2) = 2 distinct pairs
    assert len(rows) == 2 and {r["chosen"] for r in rows} == {"3", "The answer is 3."}
    assert {r["rejected"] for r in rows} == {"4", "5"} and rows[0]["id"] == "arith-train-000001-p0"
    assert make_pairs(item, ["3", "3"], 2, random.Random(0)) == []  # never wrong: nothing to prefer
    assert make_pairs(item, ["4", "7"], 2, random.Random(0)) == []  # never right


def test_build_pairs_grades_samples_and_reports_sampled_accuracy(tiny_tokenizer, monkeypatch):
    from areal.dataset import arithmetic_pairs
    from areal.dataset.arithmetic import make_arithmetic

    cfg = ArithmeticPairsConfig(
        model="unused",
        out="unused",
        n_samples=4,
        pairs_per_prompt=1,
        arithmetic=ArithmeticConfig(min_digits=2, max_digits=2, operators="+", n_train=7, n_test=2),
    )
    references = [it["reference"] for it in make_arithmetic(cfg.arithmetic, "train", cfg.seed)]
    # of each problem's 4 samples, two answer right (one in words), two wrong, one not a number
    fake = [[r, f"The answer is {r}.", str(int(r) + 1), "abc"] for r in references]
    monkeypatch.setattr(
        arithmetic_pairs, "sample_answers", lambda model, tok, items, c: fake[: len(items)]
    )
    rows, stats = build_pairs(cfg, "train", None, tiny_tokenizer)
    assert stats == {"problems": 7, "sample_accuracy": 0.5, "problems_with_pairs": 7, "pairs": 7}
    assert all(r["chosen"] in (r["reference"], f"The answer is {r['reference']}.") for r in rows)
    assert all(r["rejected"] in (str(int(r["reference"]) + 1), "abc") for r in rows)
    assert all(r["messages"][0]["content"].endswith("Answer with the number only.") for r in rows)
