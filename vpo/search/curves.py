"""Search-budget curves: problems solved and mean best score against iterations and candidates.

Inputs are :class:`~vpo.search.loop.SearchResult` objects (or their ``to_dict()`` form, e.g.
read back from JSON), grouped by arm (``{"grpo": [...], "vpo": [...]}``). A problem that
stopped early (solved, or budget spent) carries its final state forward, so every arm's curve
spans the full iteration and candidate range.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vpo.search.loop import SearchResult

__all__ = ["arm_curve", "compare_arms", "hardest_subset", "plot_curves", "search_curves"]


def _as_dict(r: SearchResult | Mapping[str, Any]) -> Mapping[str, Any]:
    return r.to_dict() if isinstance(r, SearchResult) else r


def _best_by_candidates(res: Mapping[str, Any], max_c: int) -> list[float]:
    """Best scalar score after c candidates, c = 0..max_c (exact per candidate)."""
    hist = res["history"]
    best = float(hist[0]["best_score"]) if hist else 0.0
    out = [best]
    for h in hist[1:]:
        for s in h.get("scores", []):
            best = max(best, float(s))
            out.append(best)
    if len(out) > max_c + 1:
        out = out[: max_c + 1]
    out.extend([out[-1]] * (max_c + 1 - len(out)))
    return out


def arm_curve(results: Sequence[SearchResult | Mapping[str, Any]]) -> dict[str, Any]:
    """Curves for one arm: solved count and mean best score per iteration and per candidate."""
    rs = [_as_dict(r) for r in results]
    if not rs:
        raise ValueError("arm_curve needs at least one result")
    ids = [str(r["problem_id"]) for r in rs]
    max_t = max(max(int(r.get("max_iterations", 0)), len(r["history"]) - 1) for r in rs)
    max_c = max(max(int(r.get("budget", 0)), int(r["candidates"])) for r in rs)
    solved_t = [[0] * (max_t + 1) for _ in rs]
    best_t = [[0.0] * (max_t + 1) for _ in rs]
    for i, r in enumerate(rs):
        hist = r["history"]
        for t in range(max_t + 1):
            h = hist[min(t, len(hist) - 1)]
            best_t[i][t] = float(h["best_score"])
            solved_t[i][t] = int(bool(h["solved"]))
    best_c = [_best_by_candidates(r, max_c) for r in rs]
    solved_c = []
    for r in rs:
        at = r.get("solved_at_candidates")
        solved_c.append([int(at is not None and c >= int(at)) for c in range(max_c + 1)])
    n = len(rs)
    return {
        "n_problems": n,
        "problem_ids": ids,
        "solved_ids": sorted(pid for pid, r in zip(ids, rs) if r["solved"]),
        "iterations": list(range(max_t + 1)),
        "solved_by_iteration": [sum(s[t] for s in solved_t) for t in range(max_t + 1)],
        "mean_best_by_iteration": [sum(b[t] for b in best_t) / n for t in range(max_t + 1)],
        "candidates": list(range(max_c + 1)),
        "solved_by_candidates": [sum(s[c] for s in solved_c) for c in range(max_c + 1)],
        "mean_best_by_candidates": [sum(b[c] for b in best_c) / n for c in range(max_c + 1)],
        "final_solved": sum(bool(r["solved"]) for r in rs),
        "final_mean_best": sum(float(r["best_score"]) for r in rs) / n,
        "candidates_used": sum(int(r["candidates"]) for r in rs),
    }


def search_curves(
    results: Mapping[str, Sequence[SearchResult | Mapping[str, Any]]],
) -> dict[str, dict[str, Any]]:
    """``{arm: arm_curve(results[arm])}`` for every arm."""
    return {arm: arm_curve(rs) for arm, rs in results.items()}


def compare_arms(curves_a: Mapping[str, Any], curves_b: Mapping[str, Any]) -> dict[str, Any]:
    """Problems solved by A but not B, by B but not A, by both and by neither (one arm curve each)."""
    sa, sb = set(curves_a["solved_ids"]), set(curves_b["solved_ids"])
    universe = set(curves_a["problem_ids"]) | set(curves_b["problem_ids"])
    out = {
        "a_only": sorted(sa - sb),
        "b_only": sorted(sb - sa),
        "both": sorted(sa & sb),
        "neither": sorted(universe - sa - sb),
    }
    out.update({f"n_{k}": len(v) for k, v in list(out.items())})
    out["n_problems"] = len(universe)
    return out


def plot_curves(
    curves: Mapping[str, Mapping[str, Any]], png_path: str | Path, title: str | None = None
) -> Path:
    """2x2 PNG: solved and mean best score, against iterations and against candidates, per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex="col")
    panels = [
        (0, 0, "iterations", "solved_by_iteration", "problems solved"),
        (0, 1, "candidates", "solved_by_candidates", "problems solved"),
        (1, 0, "iterations", "mean_best_by_iteration", "mean best score (w*·r)"),
        (1, 1, "candidates", "mean_best_by_candidates", "mean best score (w*·r)"),
    ]
    from vpo.plots import coinciding_note

    for r, c, x, y, ylabel in panels:
        ax = axes[r][c]
        for arm, cv in curves.items():
            label = f"{arm} ({cv['final_solved']}/{cv['n_problems']})" if r == 0 else arm
            ax.step(cv[x], cv[y], where="post", label=label)
        note = coinciding_note({arm: list(cv[x]) + list(cv[y]) for arm, cv in curves.items()})
        if note:  # identical step curves hide each other: say which
            ax.text(0.01, 0.99, note, transform=ax.transAxes, fontsize=7, color="0.3", va="top", wrap=True)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if r == 1:
            ax.set_xlabel(x)
            ax.set_ylim(-0.02, 1.02)
        else:
            n = max((cv["n_problems"] for cv in curves.values()), default=1)
            ax.set_ylim(-0.3, n + 0.3)
    axes[0][0].legend(loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _pick(value: Any, k: int) -> float | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        for key in (f"best@{k}", f"best_at_{k}", k, str(k)):
            if key in value:
                return _pick(value[key], k)
        return None
    v = float(value)
    return None if math.isnan(v) else v


def hardest_subset(
    eval_records: Mapping[str, Mapping[str, Any]] | Iterable[Mapping[str, Any]],
    k: int = 30,
    *,
    threshold: float = 1.0,
    limit: int | None = None,
) -> list[str]:
    """Problem ids that no arm solves at best@k (every arm's best@k < ``threshold``), hardest
    first (lowest mean best@k, then id); only problems evaluated by every arm count.

    ``eval_records`` is either ``{arm: {problem_id: value}}`` where value is the best@k score or
    a dict holding it under ``"best@{k}"``/``"best_at_{k}"``/``k``, or an iterable of records with
    ``arm``, ``problem_id`` (or ``id``) and ``best@{k}`` (or ``best_at_{k}``).
    """
    table: dict[str, dict[str, float]] = {}
    if isinstance(eval_records, Mapping):
        for arm, per in eval_records.items():
            for pid, value in per.items():
                v = _pick(value, k)
                if v is not None:
                    table.setdefault(str(arm), {})[str(pid)] = v
    else:
        for rec in eval_records:
            pid = rec.get("problem_id", rec.get("id"))
            v = _pick(rec, k)
            if pid is None or v is None:
                raise ValueError(f"record lacks a problem id or best@{k}: {dict(rec)}")
            table.setdefault(str(rec["arm"]), {})[str(pid)] = v
    if not table:
        return []
    common = set.intersection(*(set(per) for per in table.values()))
    tol = 1e-9
    hard = [pid for pid in common if all(per[pid] < threshold - tol for per in table.values())]
    hard.sort(key=lambda pid: (sum(per[pid] for per in table.values()) / len(table), pid))
    return hard if limit is None else hard[:limit]
