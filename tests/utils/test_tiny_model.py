import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal.cli import main
from areal.utils.tiny_model import count_parameters

TEXTS = [
    "Hello world",
    "  two leading spaces, trailing  ",
    "tabs\tand\nnewlines\n\n",
    "non-ASCII: héllo, 日本語, emoji 🚀, ß",
    "12 + 30 = 42\n#### 42",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_through_autotokenizer(tiny_tokenizer, text):
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == text


def test_tokenizer_has_pad_eos_and_chat_template(tiny_tokenizer):
    assert tiny_tokenizer.eos_token == "<|im_end|>" and tiny_tokenizer.pad_token == "<|endoftext|>"
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"


def test_cli_builds_a_model_that_transformers_loads(tmp_path, capsys):
    assert main(["tiny-model", "--out", str(tmp_path / "m")]) == 0
    assert "parameters" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    n = sum(p.numel() for p in model.parameters())
    assert 2_500_000 < n < 4_000_000 and n == count_parameters(tmp_path / "m")
    ids = torch.tensor([tok("1+2=")["input_ids"]])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))


def test_cli_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("tiny-model", "quickstart"):
        assert cmd in out
