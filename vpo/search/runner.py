"""One call to search a problem set with several checkpoints and write curves, comparison, plot.

:func:`run_arms` runs, for each named proposer (one per checkpoint, e.g. ``{"grpo": ...,
"vpo": ...}``), the evolutionary search and (optionally) the best-of-k baseline at the same
candidate budget, each with its own resumable checkpoint, then writes into ``out_dir``:

* ``results.json``: ``{arm: [SearchResult.to_dict(), ...]}`` (arms ``<name>`` and
  ``<name>/best_of_k``);
* ``curves.json``: :func:`~vpo.search.curves.search_curves` of all arms;
* ``comparison.json``: for every pair of search arms, and each arm against its own baseline,
  the problems solved by one and not the other (:func:`~vpo.search.curves.compare_arms`);
* ``curves.png``: :func:`~vpo.search.curves.plot_curves`;
* ``checkpoints/<arm>.json``: resumable search state (re-running resumes and skips finished arms).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from itertools import combinations
from pathlib import Path
from typing import Any

from vpo.search.baselines import run_best_of_k_batch
from vpo.search.curves import compare_arms, plot_curves, search_curves
from vpo.search.database import write_json
from vpo.search.loop import SearchResult, run_search_batch
from vpo.search.proposer import Proposer

__all__ = ["BASELINE_SUFFIX", "load_results", "run_arms", "search_arm"]

BASELINE_SUFFIX = "/best_of_k"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "arm"


def run_arms(
    task: Any,
    rows: Sequence[Mapping[str, Any]],
    proposers: Mapping[str, Proposer],
    out_dir: str | Path,
    *,
    iterations: int = 200,
    m: int | Mapping[str, int] = 3,
    seed: int = 0,
    budget: int | None = None,
    baseline: bool = True,
    baseline_m: int | None = None,
    prompt_mode: str = "auto",
    checkpoint_every: int = 10,
    stop_when_solved: bool = True,
    db_options: Mapping[str, Any] | None = None,
    initial_programs: Callable[[Mapping[str, Any]], Sequence[str]] | None = None,
    title: str | None = None,
    on_arm_done: Callable[[str, Sequence[SearchResult]], None] | None = None,
) -> dict[str, Any]:
    """Search ``rows`` with every proposer (plus best-of-k baselines); write and return
    ``{"results", "curves", "comparison", "paths"}`` (see the module doc). ``on_arm_done(arm, results)``
    is called after each arm's search and each baseline (progress display)."""
    out = Path(out_dir)
    ck_dir = out / "checkpoints"
    ck_dir.mkdir(parents=True, exist_ok=True)
    # ``m`` may differ per arm (a single-answer checkpoint proposes 1 candidate per call, a VPO one m):
    # every arm gets the same candidate budget, and as many calls as it needs to spend it.
    m_of = dict(m) if isinstance(m, Mapping) else {arm: int(m) for arm in proposers}
    budget = iterations * max(m_of.values()) if budget is None else int(budget)
    results: dict[str, list[SearchResult]] = {}
    for arm, proposer in proposers.items():
        results.update(search_arm(rows, task, arm, proposer, ck_dir, m=m_of[arm], budget=budget, seed=seed,
                                  baseline=baseline, baseline_m=baseline_m, prompt_mode=prompt_mode,
                                  checkpoint_every=checkpoint_every, stop_when_solved=stop_when_solved,
                                  db_options=db_options, initial_programs=initial_programs,
                                  on_arm_done=on_arm_done))
    curves = search_curves(results)
    comparison: dict[str, Any] = {}
    search_arms = [a for a in results if not a.endswith(BASELINE_SUFFIX)]
    for a, b in combinations(search_arms, 2):
        comparison[f"{a} vs {b}"] = compare_arms(curves[a], curves[b])
    for a in search_arms:
        if a + BASELINE_SUFFIX in curves:
            comparison[f"{a} vs {a}{BASELINE_SUFFIX}"] = compare_arms(curves[a], curves[a + BASELINE_SUFFIX])
    paths = {
        "results": out / "results.json",
        "curves": out / "curves.json",
        "comparison": out / "comparison.json",
        "plot": out / "curves.png",
    }
    write_json(paths["results"], {a: [r.to_dict() for r in rs] for a, rs in results.items()})
    write_json(paths["curves"], curves)
    write_json(paths["comparison"], comparison)
    plot_curves(curves, paths["plot"], title=title)
    return {
        "results": results,
        "curves": curves,
        "comparison": comparison,
        "paths": {k: str(v) for k, v in paths.items()},
    }


def search_arm(
    rows: Sequence[Mapping[str, Any]],
    task: Any,
    arm: str,
    proposer: Proposer,
    checkpoint_dir: str | Path,
    *,
    m: int,
    budget: int,
    seed: int = 0,
    baseline: bool = True,
    baseline_m: int | None = None,
    prompt_mode: str = "auto",
    checkpoint_every: int = 10,
    stop_when_solved: bool = True,
    db_options: Mapping[str, Any] | None = None,
    initial_programs: Callable[[Mapping[str, Any]], Sequence[str]] | None = None,
    on_arm_done: Callable[[str, Sequence[SearchResult]], None] | None = None,
) -> dict[str, list[SearchResult]]:
    """One arm's share of :func:`run_arms`: its search (and best-of-k baseline) at ``budget``
    candidates, checkpointed in ``checkpoint_dir``; ``{arm: ..., arm/best_of_k: ...}``. Arms are
    independent, so separate processes may search them; :func:`run_arms` over the same
    ``checkpoint_dir`` then reads the finished searches back instead of searching again."""
    if BASELINE_SUFFIX in arm:
        raise ValueError(f"arm name {arm!r} may not contain {BASELINE_SUFFIX!r}")
    ck_dir = Path(checkpoint_dir)
    ck_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[SearchResult]] = {}
    out[arm] = run_search_batch(rows, task, proposer, iterations=-(-budget // m), m=m, seed=seed, budget=budget,
                                checkpoint_path=ck_dir / f"{_slug(arm)}.search.json",
                                checkpoint_every=checkpoint_every, arm=arm, prompt_mode=prompt_mode,
                                stop_when_solved=stop_when_solved, db_options=db_options,
                                initial_programs=initial_programs)
    if on_arm_done is not None:
        on_arm_done(arm, out[arm])
    if baseline:
        name = arm + BASELINE_SUFFIX
        out[name] = run_best_of_k_batch(rows, task, proposer, budget=budget, m=baseline_m or m, seed=seed,
                                        checkpoint_path=ck_dir / f"{_slug(arm)}.best_of_k.json",
                                        checkpoint_every=checkpoint_every, arm=name,
                                        stop_when_solved=stop_when_solved)
        if on_arm_done is not None:
            on_arm_done(name, out[name])
    close = getattr(proposer, "close", None)
    if callable(close):
        close()
    return out


def load_results(path: str | Path) -> dict[str, list[SearchResult]]:
    """Read ``results.json`` written by :func:`run_arms` back into SearchResult objects."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    return {arm: [SearchResult.from_dict(d) for d in rs] for arm, rs in raw.items()}
