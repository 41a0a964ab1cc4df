"""A reward the random tiny model's completions differ on (it never solves arithmetic), so a
GRPO step has non-zero advantages and changes the weights."""


def length_reward(completion: str, reference: str) -> float:
    return float(len(completion) % 3)


def paced_length_reward(completion: str, reference: str) -> float:
    """:func:`length_reward` 0.1 s late: steps slow enough that a test acts while the run goes
    (a loaded machine starts a new rollout worker in tens of seconds; fast steps end the run)."""
    import time

    time.sleep(0.1)
    return length_reward(completion, reference)
