"""A reward the random tiny model can learn within a few steps, for quick learning comparisons
from a model that was never trained (``bench/core_layouts.py --quick``): the share of the
completion's characters that are digits. Untrained, its greedy answers are mostly other bytes;
GRPO raises the share."""


def digit_share(completion: str, reference: str) -> float:
    """Digits in ``completion`` over its length (0 for an empty one); ``reference`` unused."""
    return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0
