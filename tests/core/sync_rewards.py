"""A reward the random tiny model's completions differ on (it never solves arithmetic), so a
GRPO step has non-zero advantages and changes the weights."""


def length_reward(completion: str, reference: str) -> float:
    return float(len(completion) % 3)
