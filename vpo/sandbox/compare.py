"""Judging outputs in the parent process: stdout token comparison and value comparison.

Both run outside the sandbox on plain data (decoded from the codec), so no candidate code
takes part in a verdict.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["DEFAULT_ABS_TOL", "DEFAULT_REL_TOL", "stdout_matches", "values_match"]

DEFAULT_REL_TOL = 1e-6
DEFAULT_ABS_TOL = 1e-6


def _as_float(token: str) -> float | None:
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _close(a: float, b: float, rel_tol: float, abs_tol: float) -> bool:
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)


def stdout_matches(
    expected: str, actual: str, rel_tol: float = DEFAULT_REL_TOL, abs_tol: float = DEFAULT_ABS_TOL
) -> bool:
    """Whitespace-insensitive token comparison, the usual judge rule: outputs match when their
    whitespace-separated tokens are equal one by one, where two numeric tokens also match when
    their values agree within the float tolerance (``1.5`` vs ``1.500000``). Line breaks,
    trailing spaces and blank lines are not significant; letter case is."""
    exp_tokens = expected.split()
    act_tokens = actual.split()
    if exp_tokens == act_tokens:
        return True
    if len(exp_tokens) != len(act_tokens):
        return False
    for e, a in zip(exp_tokens, act_tokens):
        if e == a:
            continue
        fe, fa = _as_float(e), _as_float(a)
        if fe is None or fa is None or not _close(fe, fa, rel_tol, abs_tol):
            return False
    return True


def values_match(
    expected: Any, actual: Any, rel_tol: float = DEFAULT_REL_TOL, abs_tol: float = DEFAULT_ABS_TOL, depth: int = 0
) -> bool:
    """Python equality on plain values, except that floats compare within tolerance (also
    inside containers), NaN equals NaN, and a tuple equals a list with the same items (JSON
    test files cannot tell them apart). Sets compare exactly."""
    if depth > 200:
        return False
    if isinstance(expected, bool) or isinstance(actual, bool):
        return expected == actual and type(expected) is not str and type(actual) is not str
    e_num = isinstance(expected, (int, float)) and not isinstance(expected, bool)
    a_num = isinstance(actual, (int, float)) and not isinstance(actual, bool)
    if e_num and a_num:
        if isinstance(expected, float) or isinstance(actual, float):
            fe, fa = float(expected), float(actual)
            if math.isnan(fe) or math.isnan(fa):
                return math.isnan(fe) and math.isnan(fa)
            if math.isinf(fe) or math.isinf(fa):
                return fe == fa
            return _close(fe, fa, rel_tol, abs_tol)
        return expected == actual
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        return len(expected) == len(actual) and all(
            values_match(e, a, rel_tol, abs_tol, depth + 1) for e, a in zip(expected, actual)
        )
    if isinstance(expected, dict) and isinstance(actual, dict):
        if len(expected) != len(actual):
            return False
        for key, value in expected.items():
            if key not in actual or not values_match(value, actual[key], rel_tol, abs_tol, depth + 1):
                return False
        return True
    if isinstance(expected, (set, frozenset)) and isinstance(actual, (set, frozenset)):
        return expected == actual
    if type(expected) in (str, bytes, complex, type(None)) or type(actual) in (str, bytes, complex, type(None)):
        return type(expected) is type(actual) and expected == actual
    return False
