"""A reward the random tiny model's completions differ on (it never solves arithmetic), so a
GRPO step has non-zero advantages and changes the weights. It reads the completion's characters,
not its length: every token of the tiny byte-level tokenizer decodes to one character, so the
lengths of a group's completions tie in most groups and a length reward would train nothing."""


def content_reward(completion: str, reference: str) -> float:
    return (sum(map(ord, completion)) % 5) / 4  # quarters: sums and means exact in float32


def paced_content_reward(completion: str, reference: str) -> float:
    """:func:`content_reward` 0.1 s late: steps slow enough that a test acts while the run goes
    (a loaded machine starts a new rollout worker in tens of seconds; fast steps end the run)."""
    import time

    time.sleep(0.1)
    return content_reward(completion, reference)
