"""``ast.parse`` for the house-rule tests, past a CPython 3.11 defect: an AST built while another
thread of the test process changes interpreter state can raise ``SystemError: AST constructor
recursion depth mismatch`` (python/cpython#106905, fixed after 3.11.7) for valid source. Such a
parse is retried; any other error, and the same error three times running, is raised."""

from __future__ import annotations

import ast

TRIES = 3


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)``, retried on the recursion-depth SystemError only."""
    for attempt in range(TRIES):
        try:
            return ast.parse(source, filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == TRIES - 1:
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")
