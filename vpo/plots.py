"""Small matplotlib helpers shared by the result plots: plain k ticks, a y-range that shows constant
data sensibly, and a note naming lines drawn exactly on top of each other (which otherwise hide)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["coinciding", "coinciding_note", "k_axis", "y_range"]


def k_axis(ax: Any, ks: Sequence[int], label: str = "k (candidates)") -> None:
    """Log-scaled k axis with a plain tick at every k and no minor tick labels (no ``2x10^0``)."""
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    ks = sorted({int(k) for k in ks})
    if len(ks) > 1:
        ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(ks))
    ax.set_xticklabels([str(k) for k in ks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(label)


def y_range(values: Sequence[float], *, pad: float = 0.05) -> tuple[float, float]:
    """Limits for a y-axis showing ``values``: from zero (or the minimum, if negative) to the maximum,
    padded; constant data gets the same kind of range instead of matplotlib's ``v ± 4%``."""
    arr = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    if arr.size == 0:
        return 0.0, 1.0
    lo, hi = min(0.0, float(arr.min())), max(0.0, float(arr.max()))
    if hi - lo < 1e-12:
        hi = lo + 1.0
    span = hi - lo
    return lo - pad * span, hi + pad * span


def coinciding(series: Mapping[str, Sequence[float]], tol: float = 1e-9) -> list[list[str]]:
    """Groups (two or more names) of series with identical values at every point."""
    groups: list[list[str]] = []
    for name, ys in series.items():
        arr = np.asarray(ys, dtype=float)
        for group in groups:
            ref = np.asarray(series[group[0]], dtype=float)
            if ref.shape == arr.shape and np.allclose(ref, arr, atol=tol, rtol=0.0, equal_nan=True):
                group.append(name)
                break
        else:
            groups.append([name])
    return [g for g in groups if len(g) > 1]


def coinciding_note(series: Mapping[str, Sequence[float]]) -> str | None:
    """``"lines drawn on top of each other: grpo = grpo_x3"`` for every coinciding group, or None."""
    groups = coinciding(series)
    if not groups:
        return None
    return "lines drawn on top of each other: " + "; ".join(" = ".join(g) for g in groups)
