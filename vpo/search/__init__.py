"""Evolutionary test-time search with a trained policy as the proposal operator.

* :mod:`~vpo.search.database`: islands of MAP-Elites niches keyed by the reward-vector signature,
  Pareto-aware parent sampling, ring migration, JSON state.
* :mod:`~vpo.search.loop`: :func:`run_search` / :func:`run_search_batch` (resumable, budgeted).
* :mod:`~vpo.search.baselines`: best-of-k in the same harness.
* :mod:`~vpo.search.proposer`: :class:`ModelProposer`, :class:`OpenAIProposer`.
* :mod:`~vpo.search.curves`: curves, arm comparison, plot, hardest subset.
* :mod:`~vpo.search.runner`: :func:`run_arms`, one call per set of checkpoints.
* :mod:`~vpo.search.openevolve_bridge`: run OpenEvolve with our evaluator (optional extra).
"""

from vpo.search.baselines import run_best_of_k, run_best_of_k_batch
from vpo.search.curves import arm_curve, compare_arms, hardest_subset, plot_curves, search_curves
from vpo.search.database import Program, ProgramDatabase, dominates, niche_key, pareto_indices, scalarize
from vpo.search.loop import SearchResult, format_attempts, parent_prompt, run_search, run_search_batch
from vpo.search.proposer import ModelProposer, OpenAIProposer, Prompt, Proposer, ProposerError
from vpo.search.runner import load_results, run_arms, search_arm

__all__ = [
    "ModelProposer",
    "OpenAIProposer",
    "Program",
    "ProgramDatabase",
    "Prompt",
    "Proposer",
    "ProposerError",
    "SearchResult",
    "arm_curve",
    "compare_arms",
    "dominates",
    "format_attempts",
    "hardest_subset",
    "load_results",
    "niche_key",
    "parent_prompt",
    "pareto_indices",
    "plot_curves",
    "run_arms",
    "run_best_of_k",
    "run_best_of_k_batch",
    "run_search",
    "run_search_batch",
    "scalarize",
    "search_arm",
    "search_curves",
]
