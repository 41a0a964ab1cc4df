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


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_each_family_builds_a_model_that_transformers_loads_and_runs(tmp_path, family):
    out = tmp_path / family
    assert main(["tiny-model", "--out", str(out), "--family", family]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == family
    assert sum(p.numel() for p in model.parameters()) == count_parameters(out)
    names = {n for n, _ in model.named_parameters()}
    if family in ("qwen3", "qwen3_moe"):  # Qwen3's per-head q/k RMSNorms
        assert "model.layers.0.self_attn.q_norm.weight" in names
    if family == "llama":
        assert "lm_head.weight" in names and not model.config.tie_word_embeddings
    if family == "qwen3_moe":
        assert model.config.num_experts == 8 and model.config.num_experts_per_tok == 2
    ids = torch.tensor([[1, 2, 3, 4]])
    out_logits = model(ids).logits
    assert out_logits.shape == (1, 4, model.config.vocab_size) and torch.isfinite(out_logits).all()


def test_the_cli_offers_every_family_the_builder_makes():
    from areal.cli import TINY_FAMILIES
    from areal.utils.tiny_model import FAMILIES

    assert TINY_FAMILIES == FAMILIES
