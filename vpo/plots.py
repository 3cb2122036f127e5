"""Small matplotlib helpers shared by the result plots: plain k ticks, a y-range that shows constant
data sensibly, and a note naming lines drawn exactly on top of each other (which otherwise hide)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["LEARNING_CURVES", "coinciding", "coinciding_note", "k_axis", "learning_curves", "y_range"]


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


LEARNING_CURVES: tuple[tuple[str, str], ...] = (
    ("reward", "training reward (w*-best answer)"),
    ("vpo/expected_max", "E_w[max over the answer set]"),
    ("vpo/reward_diversity", "reward diversity within a group"),
    ("vpo/frac_unparsed", "unparsed rollouts"),
)
"""(history key, panel title) of the training curves drawn per arm: keys VPOTrainer logs every step."""


def learning_curves(histories: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], path: Any, title: str,
                    *, smooth: int = 5) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """One panel per :data:`LEARNING_CURVES` key: per arm the mean over its runs (seeds) of the
    logged value against the training step, smoothed over ``smooth`` logged points, with the
    min-max band over runs. ``histories`` maps arm -> one list of log records per run. Returns what
    was drawn: key -> arm -> (steps, means)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    fig, axes = plt.subplots(1, len(LEARNING_CURVES), figsize=(4.2 * len(LEARNING_CURVES), 3.8))
    for ax, (key, label) in zip(axes, LEARNING_CURVES):
        for arm, runs in histories.items():
            series = []
            for rec in runs:
                pts = [(r["step"], float(r[key])) for r in rec if r.get(key) is not None and r.get("step") is not None]
                if pts:
                    series.append(dict(pts))
            if not series:
                continue
            steps = sorted(set.intersection(*(set(s) for s in series)))
            if not steps:
                continue
            vals = np.array([[s[t] for t in steps] for s in series])
            if smooth > 1 and len(steps) >= smooth:
                kernel = np.ones(smooth) / smooth
                vals = np.array([np.convolve(v, kernel, mode="valid") for v in vals])
                steps = steps[smooth - 1:]
            (line,) = ax.plot(steps, vals.mean(0), label=f"{arm} (n={len(series)})")
            drawn.setdefault(key, {})[arm] = (list(steps), vals.mean(0).tolist())
            if len(series) > 1:
                ax.fill_between(steps, vals.min(0), vals.max(0), alpha=0.15, color=line.get_color())
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{title}  (line: mean over seeds of a {smooth}-point moving average, band: min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn
