"""Judging outputs in the parent process: stdout token comparison and value comparison.

Everything here runs outside the sandbox on plain data (decoded from the codec), so no
candidate code takes part in a verdict. Every function is total on plain data: a comparison that
Python would answer with an exception (``abs([1] - 0.5)``, ``float(10**400)``) is a failed
comparison, never an exception out of the judge.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = [
    "CMP_KINDS",
    "DEFAULT_ABS_TOL",
    "DEFAULT_REL_TOL",
    "MAX_NUMBER_CHARS",
    "Meter",
    "OverBudget",
    "exact_equal",
    "judge_value",
    "render_value",
    "stdout_matches",
    "stdout_verdict",
    "values_match",
]

DEFAULT_REL_TOL = 1e-6
DEFAULT_ABS_TOL = 1e-6
CMP_KINDS = ("eq", "ne", "is", "is_not", "truthy", "falsy", "abs_lt", "abs_le")
# A candidate token that differs from the expected one as text is compared as a number only up to
# this many characters (or twice the expected token's length, if longer): parsing a longer one would
# cost the judge time for nothing an honest program prints.
MAX_NUMBER_CHARS = 4096
_TICK_EVERY = 1024  # tokens or container items between two looks at the judging meter

Meter = Callable[[int], None]  # told how much work was done; raises OverBudget to stop judging


class OverBudget(BaseException):
    """Raised by a :data:`Meter`: judging this output has spent what the candidate had left (a
    BaseException, so that no comparison's own failure handling can swallow it)."""


def _scan_number(token: str) -> int:
    """What ``token`` is, in one linear pass and ASCII only: 0 not a number, 1 an integer
    (``[+-]digits``), 2 another decimal number (``1.5``, ``.5``, ``1.``, ``2e-3``). No pattern
    that can backtrack ever sees candidate data; look-alikes that Python's ``float`` and
    ``Decimal`` accept (``1_0``, non-ASCII digits, ``inf``) are not numbers here."""
    if not token.isascii():
        return 0
    body = token[1:] if token[:1] in ("+", "-") else token
    mantissa, e, exponent = body.replace("E", "e").partition("e")
    if e:
        exponent = exponent[1:] if exponent[:1] in ("+", "-") else exponent
        if not exponent.isdigit():
            return 0
    whole, dot, frac = mantissa.partition(".")
    if not (whole or frac) or (whole and not whole.isdigit()) or (frac and not frac.isdigit()):
        return 0
    return 1 if not (dot or e) else 2


def _as_float(token: str) -> float | None:
    try:
        value = float(token)
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def _close(a: float, b: float, rel_tol: float, abs_tol: float) -> bool:
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)


def _token_matches(e: str, a: str, rel_tol: float, abs_tol: float) -> bool:
    kind_e = _scan_number(e)
    if not kind_e or not _scan_number(a):
        return False
    if kind_e == 1:
        # an integer answer is exact: 1000000007 is not 1000000000, whatever the float tolerance
        try:
            return Decimal(a) == Decimal(e)
        except (InvalidOperation, ValueError, OverflowError):
            return False
    fe, fa = _as_float(e), _as_float(a)
    return fe is not None and fa is not None and _close(fe, fa, rel_tol, abs_tol)


def stdout_verdict(
    expected: str, actual: str, rel_tol: float = DEFAULT_REL_TOL, abs_tol: float = DEFAULT_ABS_TOL,
    meter: Meter | None = None,
) -> str | None:
    """Why ``actual`` does not match ``expected`` (None: it matches), by the rule of
    :func:`stdout_matches`. Linear in the output's size: a candidate token that differs from the
    expected one as text and is longer than ``max(MAX_NUMBER_CHARS, 2 * len(expected token))``
    fails as "output token too long" without being parsed. ``meter`` is told the work done every
    ``_TICK_EVERY`` tokens (judging stops when it raises)."""
    exp_tokens = expected.split()
    act_tokens = actual.split()
    if meter is not None:
        meter(len(exp_tokens) + len(act_tokens))
    if exp_tokens == act_tokens:
        return None
    if len(exp_tokens) != len(act_tokens):
        return f"wrong output ({len(act_tokens)} tokens, expected {len(exp_tokens)})"
    for k, (e, a) in enumerate(zip(exp_tokens, act_tokens)):
        if e == a:
            continue
        if meter is not None and k % _TICK_EVERY == 0:
            meter(_TICK_EVERY)
        cap = max(MAX_NUMBER_CHARS, 2 * len(e))
        if len(a) > cap:
            return f"output token too long (token {k + 1}: {len(a)} characters; at most {cap} are compared as a number)"
        if not _token_matches(e, a, rel_tol, abs_tol):
            return "wrong output"
    return None


def stdout_matches(
    expected: str, actual: str, rel_tol: float = DEFAULT_REL_TOL, abs_tol: float = DEFAULT_ABS_TOL
) -> bool:
    """Whitespace-insensitive token comparison, the usual judge rule: outputs match when their
    whitespace-separated tokens are equal one by one, where a numeric token also matches a
    number of the same value (``2`` vs ``2.000``), within the float tolerance when the expected
    token is not an integer (``1.5`` vs ``1.5000001``). Integers compare exactly. Line breaks,
    trailing spaces and blank lines are not significant; letter case is. Numbers are ASCII
    decimals (``[+-]``, digits, one ``.``, an exponent); a token over the length cap
    (:data:`MAX_NUMBER_CHARS`) that is not the expected text fails."""
    return stdout_verdict(expected, actual, rel_tol, abs_tol) is None


def _is_num(x: Any) -> bool:
    return type(x) in (int, float)


def values_match(
    expected: Any, actual: Any, rel_tol: float = DEFAULT_REL_TOL, abs_tol: float = DEFAULT_ABS_TOL, depth: int = 0,
    meter: Meter | None = None,
) -> bool:
    """The tolerant judge (JSON-sourced tests): Python equality on plain values, except that a
    float expected value matches within tolerance (also inside containers), NaN equals NaN,
    and a tuple equals a list with the same items (JSON cannot tell them apart). Integers are
    exact: an int expected value needs a number of exactly that value. Sets compare exactly.
    ``meter`` is told the items compared, a slice at a time (judging stops when it raises)."""
    if depth > 200:
        return False
    if type(expected) is bool or type(actual) is bool:
        return expected == actual and type(expected) is not str and type(actual) is not str
    if _is_num(expected) and _is_num(actual):
        if type(expected) is int:
            return expected == actual  # int == float is exact in Python (no overflow)
        try:
            fe, fa = float(expected), float(actual)
        except OverflowError:  # an int beyond float range is never close to a finite float
            return False
        if math.isnan(fe) or math.isnan(fa):
            return math.isnan(fe) and math.isnan(fa)
        if math.isinf(fe) or math.isinf(fa):
            return fe == fa
        return _close(fe, fa, rel_tol, abs_tol)
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        if len(expected) != len(actual):
            return False
        if meter is None:
            return all(values_match(e, a, rel_tol, abs_tol, depth + 1) for e, a in zip(expected, actual))
        for k, (e, a) in enumerate(zip(expected, actual)):
            if k % _TICK_EVERY == 0:
                meter(_TICK_EVERY)
            if not values_match(e, a, rel_tol, abs_tol, depth + 1, meter):
                return False
        return True
    if isinstance(expected, dict) and isinstance(actual, dict):
        if len(expected) != len(actual):
            return False
        for k, (key, value) in enumerate(expected.items()):
            if meter is not None and k % _TICK_EVERY == 0:
                meter(_TICK_EVERY)
            if key not in actual or not values_match(value, actual[key], rel_tol, abs_tol, depth + 1, meter):
                return False
        return True
    if isinstance(expected, (set, frozenset)) and isinstance(actual, (set, frozenset)):
        return expected == actual
    if type(expected) in (str, bytes, complex, type(None)) or type(actual) in (str, bytes, complex, type(None)):
        return type(expected) is type(actual) and expected == actual
    return False


def exact_equal(expected: Any, actual: Any) -> bool:
    """Python's own ``expected == actual`` on plain values (what an ``assert f(x) == y`` of the
    dataset computes): a tuple is not a list, ``1 == 1.0 == True``, floats exact, NaN unequal."""
    try:
        return bool(expected == actual)
    except Exception:  # noqa: BLE001 - e.g. RecursionError on pathological nesting
        return False


def judge_value(
    cmp: str,
    expected: Any,
    actual: Any,
    *,
    alternatives: tuple[Any, ...] = (),
    equality: str = "tolerant",
    tol: float | None = None,
    rel_tol: float = DEFAULT_REL_TOL,
    abs_tol: float = DEFAULT_ABS_TOL,
    meter: Meter | None = None,
) -> bool:
    """Whether ``actual`` passes a test: ``eq`` / ``ne`` (``equality`` exact = Python ``==``,
    tolerant = :func:`values_match`; ``tol`` overrides the tolerance), ``is`` / ``is_not``
    (identity with True, False or None, as ``assert f(x) is True``), ``truthy`` / ``falsy``
    (``assert f(x)`` / ``assert not f(x)``), ``abs_lt`` / ``abs_le`` (``abs(f(x) - expected) <
    tol``). Any exception Python would raise evaluating the check counts as a failure (but
    the meter's :class:`OverBudget`, which stops judging)."""
    try:
        if cmp in ("eq", "ne"):
            if equality == "exact":
                same = any(exact_equal(e, actual) for e in (expected, *alternatives))
            else:
                rel, abs_ = (0.0, tol) if tol is not None else (rel_tol, abs_tol)
                same = any(values_match(e, actual, rel, abs_, 0, meter) for e in (expected, *alternatives))
            return same if cmp == "eq" else not same
        if cmp == "is":
            return actual is expected
        if cmp == "is_not":
            return actual is not expected
        if cmp == "truthy":
            return bool(actual)
        if cmp == "falsy":
            return not actual
        if cmp in ("abs_lt", "abs_le"):
            if tol is None:
                return False
            diff = abs(actual - expected)
            return bool(diff < tol) if cmp == "abs_lt" else bool(diff <= tol)
    except Exception:  # noqa: BLE001 - TypeError, OverflowError...: the dataset's assert would fail
        return False
    raise ValueError(f"unknown comparison {cmp!r}; expected one of {', '.join(CMP_KINDS)}")


class _Full(Exception):
    pass


def render_value(value: Any, limit: int = 2000) -> str:
    """``repr`` of plain data, bounded in time and size: stops after ``limit`` characters and
    shows huge ints by size (their decimal form is quadratic to compute)."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + "..."
    parts: list[str] = []
    size = 0

    def emit(s: str) -> None:
        nonlocal size
        parts.append(s)
        size += len(s)
        if size > limit:
            raise _Full

    def seq(open_: str, items: Any, close: str, depth: int) -> None:
        emit(open_)
        for k, item in enumerate(items):
            if k:
                emit(", ")
            walk(item, depth + 1)
        emit(close)

    def walk(x: Any, depth: int) -> None:
        t = type(x)
        if depth > 60:
            emit("...")
        elif t is int:
            emit(repr(x) if x.bit_length() < 3000 else f"<int of {x.bit_length()} bits>")
        elif t in (str, bytes):
            emit(repr(x[: limit + 1]))
        elif t in (float, complex, bool) or x is None:
            emit(repr(x))
        elif t is list:
            seq("[", x, "]", depth)
        elif t is tuple:
            seq("(", x, ",)" if len(x) == 1 else ")", depth)
        elif t in (set, frozenset):
            if not x:
                emit("set()" if t is set else "frozenset()")
            elif t is set:
                seq("{", x, "}", depth)
            else:
                seq("frozenset({", x, "})", depth)
        elif t is dict:
            emit("{")
            for k, (key, item) in enumerate(x.items()):
                if k:
                    emit(", ")
                walk(key, depth + 1)
                emit(": ")
                walk(item, depth + 1)
            emit("}")
        else:
            emit(f"<{t.__name__}>")

    try:
        walk(value, 0)
    except _Full:
        return "".join(parts)[:limit] + "..."
    except Exception:  # noqa: BLE001 - plain data only, but stay total
        return "<unprintable>"
    return "".join(parts)
