"""Math answer verification: extract the final answer from a completion and compare it with the
reference through ``math-verify``, with a plain numeric comparison as the fast path.

Extraction order for a completion (the first rule that matches wins):

1. the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced;
2. the last ``#### N`` (GSM8K style);
3. the last "the answer is N" / "Answer: N" / "final answer: N";
4. the whole completion when it is a bare answer (no whitespace, e.g. ``\\frac{1}{2}``);
5. the last number in the text.

The reference may be a whole GSM8K solution ending in ``#### 18``, a LaTeX or ``\\boxed{}``
answer, or a bare answer. Untrusted model output that cannot be parsed scores 0.0.

``math_verify.parse``/``verify`` enforce their own timeouts with ``signal.alarm``, which only works
on the main thread; off the main thread we pass ``None`` and rely on the caller's deadline
(:class:`areal.reward.runner.RewardRunner` kills a late worker process).
"""

from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(
    r"(?:the\s+(?:final\s+)?answer\s+is|final\s+answer\s*:|answer\s*:)\s*([^\n]+)", re.IGNORECASE
)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_VERIFY_TIMEOUT = 5  # seconds, only used on the main thread (signal.alarm)

logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" warning


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or None."""
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None  # unbalanced: the model never closed the box


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion by the rules in the module docstring, or None."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    for pattern in (_HASHES, _ANSWER_IS):
        matches = pattern.findall(completion)
        if matches:
            return _trim_sentence(matches[-1])
    bare = completion.strip()
    if bare and not any(ch.isspace() for ch in bare):
        return bare.rstrip(".")
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def extract_reference(reference: str) -> str:
    """The answer part of a reference: after ``####``, inside ``\\boxed{}``, else all of it."""
    if "####" in reference:
        return reference.rsplit("####", 1)[1].strip()
    boxed = last_boxed(reference)
    return boxed if boxed is not None else reference.strip()


def _trim_sentence(answer: str) -> str:
    answer = answer.strip()
    # "The answer is 18. Hope it helps" -> "18"; keep decimals like 1.5 intact.
    answer = re.split(r"\.\s|\.$", answer, maxsplit=1)[0]
    return answer.strip().strip("*").strip()


def to_number(text: str) -> Fraction | None:
    """``text`` as an exact number if it is a plain one after removing ``$``, ``%``, thousands
    separators, spaces, LaTeX spacing and a trailing period; otherwise None."""
    s = text.strip()
    for junk in ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\ ", " ", "{", "}"):
        s = s.replace(junk, "")
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", s):
        return Fraction(s)
    if re.fullmatch(r"-?\d+/\d+", s) and not s.endswith("/0"):
        return Fraction(s)
    return None


def _math_verify_equal(reference: str, answer: str) -> bool:
    from math_verify import parse, verify

    timeout = _VERIFY_TIMEOUT if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${reference}$", parsing_timeout=timeout)
    pred = parse(f"${answer}$", parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


def answers_equal(reference_answer: str, answer: str) -> bool:
    """True when two extracted answers denote the same value (numeric, then math-verify)."""
    ref_num, num = to_number(reference_answer), to_number(answer)
    if ref_num is not None and num is not None:
        return ref_num == num
    try:
        return _math_verify_equal(reference_answer, answer)
    except Exception:  # malformed LaTeX from the model: unparseable output scores 0
        return False


def math_reward(completion: str, reference: str) -> float:
    """1.0 if the completion's final answer equals the reference's, else 0.0."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0  # no answer found in untrusted output: scores 0
    return 1.0 if answers_equal(extract_reference(reference), answer) else 0.0
