"""Build a tiny Hugging Face model directory for tests and the embedded demo: a random model of
one family (Qwen2, the default; Qwen3 with its q/k norms; Llama 3.1 with an untied head and llama3
rope scaling; Qwen3-MoE with 8 experts, 2 per token), all with one tokenizer. The embedded server
serves all four.

The tokenizer is byte-level BPE with no merges, laid out like Qwen2's (ByteLevel pre-tokenizer and
decoder, ChatML special tokens), so it round-trips any text even when transformers 5.x forces
``Qwen2Tokenizer`` for ``model_type: qwen2``: one token per UTF-8 byte, plus three specials.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

# ChatML; with ``tools``, a system turn listing them compactly (``Tools:``, then one line
# ``name(arg,arg)`` per tool: the byte-level tokenizer spends a token per character, so a JSON
# schema would cost hundreds) and Hermes-style <tool_call> blocks (the format Qwen2.5 uses), so the
# server's tool calling runs on the tiny model too.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}"
    "{{ '\\n' ~ t['function']['name'] }}("
    "{{ t['function'].get('parameters', {}).get('properties', {}) | join(',') }}){% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>\n"
    "{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] }}}\n</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class TinySize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


SIZES = {
    "tiny": TinySize(256, 768, 4, 4, 2),  # ~3.2M parameters
    "small": TinySize(512, 1536, 8, 8, 4),  # ~25M parameters
}


def build_tokenizer():
    """Byte-level BPE (256 byte tokens, no merges) with pad, eos and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


FAMILIES = ("qwen2", "qwen3", "llama", "qwen3_moe")


def family_config(family: str, dims: TinySize, vocab_size: int, **common):
    """The ``transformers`` config of a tiny ``family`` model with ``dims`` (``common``: ids,
    context length, dtype)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    shape = dict(
        vocab_size=vocab_size,
        hidden_size=dims.hidden_size,
        intermediate_size=dims.intermediate_size,
        num_hidden_layers=dims.num_hidden_layers,
        num_attention_heads=dims.num_attention_heads,
        num_key_value_heads=dims.num_key_value_heads,
        **common,
    )
    head_dim = dims.hidden_size // dims.num_attention_heads  # Qwen3's default (128) is too big
    if family == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **shape)
    if family == "qwen3":
        return Qwen3Config(tie_word_embeddings=True, head_dim=head_dim, **shape)
    if family == "llama":  # Llama 3.1+: untied head, no attention biases, llama3 rope scaling
        rope = dict(  # Llama 3.1's factors; pretrained on a quarter of the context (512 of 2048)
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=common["max_position_embeddings"] // 4,
        )
        return LlamaConfig(tie_word_embeddings=False, rope_parameters=rope, **shape)
    if family == "qwen3_moe":  # every layer sparse: 8 experts of a quarter width, top-2
        return Qwen3MoeConfig(
            tie_word_embeddings=True,
            head_dim=head_dim,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=dims.intermediate_size // 4,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            **shape,
        )
    raise ValueError(f"--family {family!r} is not one of {list(FAMILIES)}")


def build_tiny_model(
    out: str | Path,
    size: str = "tiny",
    seed: int = 0,
    max_position_embeddings: int = 2048,
    family: str = "qwen2",
) -> Path:
    """Write config, safetensors weights and tokenizer of a random ``family`` model to ``out``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if size not in SIZES:
        raise ValueError(f"--size {size!r} is not one of {sorted(SIZES)}")
    if family not in FAMILIES:
        raise ValueError(f"--family {family!r} is not one of {list(FAMILIES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = family_config(
        family,
        SIZES[size],
        len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def count_parameters(model_dir: str | Path) -> int:
    """Parameter count read from the safetensors files (no model instantiation)."""
    from safetensors import safe_open

    total = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                total += math.prod(sf.get_slice(k).get_shape())
    return total
