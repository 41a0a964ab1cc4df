"""Chat-template tokenization shared by datasets and workflows (token ids in, token ids out).

``apply_chat_template`` is rendered to text and tokenized without extra special tokens, which
behaves the same across transformers versions (4.x returns a list, 5.x a BatchEncoding).
"""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, str]]


def chat_text(tokenizer: Any, messages: Messages, add_generation_prompt: bool) -> str:
    """The chat template rendered as text."""
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with no BOS/EOS added (templates carry their own)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer: Any, messages: Messages) -> list[int]:
    """Token ids of the conversation so far plus the assistant header (the RL prompt)."""
    return encode(tokenizer, chat_text(tokenizer, messages, add_generation_prompt=True))


def sft_tokens(tokenizer: Any, messages: Messages) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation: loss on assistant turns only.

    Each assistant turn is the text between the template rendered up to the previous message
    plus the generation prompt and the template rendered through that turn; the template must
    render prefixes as prefixes (ChatML does), otherwise a ValueError says so.
    """
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            head = chat_text(tokenizer, messages[:k], add_generation_prompt=True)
        else:
            head = chat_text(tokenizer, messages[:k], add_generation_prompt=False) if k else ""
        full = chat_text(tokenizer, messages[: k + 1], add_generation_prompt=False)
        rendered = tokenizer.decode(input_ids) if input_ids else ""
        if not head.startswith(rendered) or not full.startswith(head):
            raise ValueError(
                "sft_tokens: the chat template does not render prefixes of the conversation as "
                "prefixes; SFT loss masks need a prefix-stable template such as ChatML"
            )
        context = encode(tokenizer, head[len(rendered) :])
        turn = encode(tokenizer, full[len(head) :])
        train = 1 if message["role"] == "assistant" else 0
        input_ids += context + turn
        loss_mask += [0] * len(context) + [train] * len(turn)
    return input_ids, loss_mask
