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

:func:`math_reward` never raises and returns within one deadline (``VERIFY_DEADLINE`` seconds,
parse and verify together): anything unparseable, numbers past Python's int-string limit
(4300 digits) included, scores 0. ``math_verify``'s own timeouts use ``signal.alarm`` (main thread
only) and cannot stop a C-level big-integer computation such as ``9^{9^{9^{9}}}``, which holds
the GIL; so parse + verify run in a forked child that is SIGKILLed at the deadline (its
RLIMIT_CPU also ends it should we die first). Plain numbers never reach it (fast path).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import resource
import select
import signal
from fractions import Fraction

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_HASHES = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(
    r"(?:the\s+(?:final\s+)?answer\s+is|final\s+answer\s*:|answer\s*:)\s*([^\n]+)", re.IGNORECASE
)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
VERIFY_DEADLINE = 5.0  # seconds for math-verify's parse + verify of one answer pair

logger = logging.getLogger(__name__)
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
    if not (re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", s) or re.fullmatch(r"-?\d+/\d+", s)):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):  # past the int-string limit, or n/0: not a number
        return None


def _math_verify_equal(reference: str, answer: str) -> bool:
    from math_verify import parse, verify

    gold = parse(f"${reference}$", parsing_timeout=None)  # the caller's deadline bounds us
    pred = parse(f"${answer}$", parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


@functools.cache
def _warm_math_verify() -> None:
    """Import math-verify and build its LaTeX parser here, once, on fixed input: every child
    inherits them (a cold child pays ~0.25 s, a warm one ~10 ms)."""
    _math_verify_equal("\\frac{1}{2}", "x^2")


def _verify_before_deadline(reference: str, answer: str, deadline: float) -> bool:
    """:func:`_math_verify_equal` in a forked child; False when it fails or passes ``deadline``."""
    _warm_math_verify()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: one byte of verdict, then exit without touching the parent's state
        try:
            os.close(read_end)
            cpu = math.ceil(deadline) + 1  # seconds; ends the child even if we die first
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
            os.write(write_end, b"1" if _math_verify_equal(reference, answer) else b"0")
        finally:
            os._exit(0)
    os.close(write_end)
    verdict = b""
    try:
        if select.select([read_end], [], [], deadline)[0]:
            verdict = os.read(read_end, 1)  # b"" when the child died without a verdict
    finally:
        os.close(read_end)
        if not verdict:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if not verdict:
        # Untrusted output that math-verify cannot settle in time (or crashes on) scores 0.
        logger.debug("math_reward: no verdict within %.1fs for %.80r; scored 0", deadline, answer)
    return verdict == b"1"


def answers_equal(reference_answer: str, answer: str, deadline: float = VERIFY_DEADLINE) -> bool:
    """True when two extracted answers denote the same value (numeric, then math-verify within
    ``deadline`` seconds); never raises."""
    ref_num, num = to_number(reference_answer), to_number(answer)
    if ref_num is not None and num is not None:
        return ref_num == num
    return _verify_before_deadline(reference_answer, answer, deadline)


def math_reward(completion: str, reference: str, deadline: float = VERIFY_DEADLINE) -> float:
    """1.0 if the completion's final answer equals the reference's, else 0.0; never raises, and
    returns within ``deadline`` seconds plus the (linear-time) answer extraction."""
    answer = extract_answer(str(completion))
    if answer is None:
        return 0.0  # no answer found in untrusted output: scores 0
    return 1.0 if answers_equal(extract_reference(str(reference)), answer, deadline) else 0.0
