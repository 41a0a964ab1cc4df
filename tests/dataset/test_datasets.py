"""Datasets: arithmetic generator, GSM8K, generic jsonl (with located errors), tokenization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal.api.config.data import ArithmeticConfig, DatasetConfig
from areal.api.config.loader import ConfigError, from_dict
from areal.dataset import DatasetError, load_dataset, load_gsm8k, load_jsonl, make_arithmetic
from areal.dataset.arithmetic import draw_problem
from areal.reward.math import math_reward

GSM8K_DIR = Path(__file__).resolve().parents[3] / "shared/data/gsm8k"


def test_arithmetic_answers_are_exact_and_left_to_right():
    cfg = ArithmeticConfig(min_steps=2, max_steps=3, operators="+-*", worked_steps=True,
                           allow_negative=True, n_train=300, n_test=30)  # fmt: skip
    for item in make_arithmetic(cfg, "train", seed=3):
        expression = item["messages"][0]["content"].split(" = ?")[0]
        tokens = expression.split()
        value = int(tokens[0])
        for op, rhs in zip(tokens[1::2], tokens[2::2]):
            value = {"+": value + int(rhs), "-": value - int(rhs), "*": value * int(rhs)}[op]
        assert item["reference"] == str(value)
        assert item["solution"].endswith(f"The answer is {value}.")
        assert math_reward(item["solution"], item["reference"]) == 1.0


def test_arithmetic_splits_never_overlap_and_are_seeded():
    cfg = ArithmeticConfig(n_train=2000, n_test=200)
    train = make_arithmetic(cfg, "train", seed=0)
    test = make_arithmetic(cfg, "test", seed=0)
    q = lambda items: {i["messages"][0]["content"] for i in items}  # noqa: E731
    assert len(q(train)) == 2000 and len(q(test)) == 200
    assert not q(train) & q(test)
    assert not q(train) & q(make_arithmetic(cfg, "test", seed=5))
    assert train == make_arithmetic(cfg, "train", seed=0)
    assert train != make_arithmetic(cfg, "train", seed=1)


def test_default_arithmetic_is_small_addition_and_subtraction():
    import random

    rng = random.Random(0)
    for _ in range(200):
        problem = draw_problem(rng, ArithmeticConfig())
        if problem is None:
            continue
        a, op, b = problem[0].split()
        assert op in "+-" and len(a) <= 2 and len(b) <= 2 and problem[1] >= 0


def test_too_small_problem_space_fails_with_a_fix():
    cfg = ArithmeticConfig(max_digits=1, operators="+", n_train=500)
    with pytest.raises(ValueError, match="lower arithmetic.n_train"):
        make_arithmetic(cfg, "train")


def test_arithmetic_config_checks_ranges_and_operators():
    with pytest.raises(ConfigError) as e:
        from_dict(DatasetConfig, {"arithmetic": {"operators": "+/", "min_digits": 3}})
    assert "operators" in str(e.value) and "min_digits" in str(e.value)


@pytest.mark.skipif(not (GSM8K_DIR / "test.jsonl").is_file(), reason="GSM8K not present")
def test_gsm8k_from_a_local_directory_keeps_the_reference(tiny_tokenizer):
    items = load_gsm8k(str(GSM8K_DIR), split="test")
    assert len(items) == 1319 and items[0]["id"] == "gsm8k-test-00001"
    assert items[0]["reference"].endswith("#### 18")
    assert "####" in items[0]["messages"][0]["content"]  # the instruction
    cfg = DatasetConfig(path=str(GSM8K_DIR / "test.jsonl"), split="test", size=5, max_length=400)
    ds = load_dataset(cfg, tiny_tokenizer)
    assert tiny_tokenizer.decode(ds[0]["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert all(len(item["prompt_ids"]) <= 400 for item in ds.items)


def test_gsm8k_row_without_answer_names_file_line_and_field(tmp_path):
    path = tmp_path / "gsm8k_bad.jsonl"
    path.write_text(
        json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + '{"question": "q"}\n'
    )
    with pytest.raises(DatasetError, match=r"gsm8k_bad.jsonl:2: GSM8K field 'answer'"):
        load_gsm8k(str(path))


def _write(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_generic_jsonl_rl_sft_rw_items(tmp_path, tiny_tokenizer):
    rl = _write(tmp_path / "rl.jsonl", [{"prompt": "1+1?", "answer": "2", "topic": "add"},
                                        {"id": "x", "messages": [{"role": "user", "content": "hi"}],
                                         "reference": "3"}])  # fmt: skip
    items = load_jsonl(rl, "rl")
    assert items[0] == {"id": "rl-1", "topic": "add", "reference": "2",
                        "messages": [{"role": "user", "content": "1+1?"}]}  # fmt: skip
    assert items[1]["id"] == "x"
    sft = _write(tmp_path / "sft.jsonl", [{"prompt": "p", "completion": "c"}])
    ds = load_dataset(DatasetConfig(path=str(sft), type="sft", batch_size=1), tiny_tokenizer)
    target = [t for t, m in zip(ds[0]["input_ids"], ds[0]["loss_mask"]) if m]
    assert tiny_tokenizer.decode(target).startswith("c<|im_end|>")
    rw = _write(tmp_path / "rw.jsonl", [{"prompt": "p", "chosen": "good", "rejected": "bad"}])
    ds = load_dataset(DatasetConfig(path=str(rw), type="rw", batch_size=1), tiny_tokenizer)
    pair = ds[0]
    assert pair["chosen_ids"][: pair["prompt_len"]] == pair["rejected_ids"][: pair["prompt_len"]]


@pytest.mark.parametrize(
    "type, rows, message",
    [
        ("rl", [{"prompt": "p", "reference": "1"}, {"prompt": "p"}],
         r"bad.jsonl:2: missing field 'reference' or 'answer'"),
        ("sft", [{"prompt": "p"}], r"bad.jsonl:1: missing field 'completion'"),
        ("sft", [{"messages": [{"role": "user", "content": "u"}]}],
         r"bad.jsonl:1: .*must end with an assistant"),
        ("rw", [{"prompt": "p", "chosen": "c"}], r"bad.jsonl:1: missing field 'rejected'"),
        ("rl", ['{"prompt": "p",'], r"bad.jsonl:1: invalid JSON"),
        ("rl", [{"id": "a", "prompt": "p", "answer": 1}, {"id": "a", "prompt": "q", "answer": 2}],
         "duplicate id 'a'"),
    ],
)  # fmt: skip
def test_generic_jsonl_errors_name_file_line_and_field(tmp_path, type, rows, message):
    with pytest.raises(DatasetError, match=message):
        load_jsonl(_write(tmp_path / "bad.jsonl", rows), type)
