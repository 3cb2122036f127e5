"""The search stage's table (vpo.pipeline.stages.search.search_table): an arm whose evolutionary search
found exactly what its best-of-k found, because its proposals never saw their parents, is one row
with the reason in the caption, not two identical rows."""

from __future__ import annotations

from typing import Any

from vpo.pipeline.stages.search import _parents_unseen, search_table
from vpo.search.curves import compare_arms


def _curves(solved: dict[str, list[str]]) -> dict[str, Any]:
    ids = ["p0", "p1", "p2"]
    return {a: {"n_problems": 3, "problem_ids": ids, "solved_ids": s, "final_solved": len(s), "final_mean_best": 0.5,
                "candidates_used": 9} for a, s in solved.items()}


def _table(solved: dict[str, list[str]], blind: str | None) -> str:
    curves = _curves(solved)
    arms = [a for a in curves if "/" not in a]
    comparison = {f"{a} vs {b}": compare_arms(curves[a], curves[b]) for i, a in enumerate(arms) for b in arms[i + 1:]}
    comparison |= {f"{a} vs {a}/best_of_k": compare_arms(curves[a], curves[f"{a}/best_of_k"]) for a in arms}
    return search_table(curves, comparison, ["p2"], 5, reference="vpo", blind=blind)


def test_a_search_that_is_best_of_k_is_one_row_and_the_caption_says_why() -> None:
    solved = {"grpo": ["p0"], "vpo": ["p1", "p2"], "grpo/best_of_k": ["p0"], "vpo/best_of_k": ["p1"]}
    why = _parents_unseen("auto", type("RouteLike", (), {"name": "route"})())
    assert why is not None and "has no search prompt" in why
    table = _table(solved, why)
    rows = [ln for ln in table.splitlines() if ln.startswith(("| grpo", "| vpo"))]
    assert "| grpo (= best-of-k) | 1/3 | 0 | 0.500 | 9 |" in rows and not any("grpo/best_of_k" in r for r in rows)
    assert any(r.startswith("| vpo | 2/3") for r in rows) and any(r.startswith("| vpo/best_of_k | 1/3") for r in rows)
    assert "| vpo vs vpo/best_of_k | 1 | 0 | 1 | 1 |" in rows  # vpo's search did differ: its pair stays
    assert "Search and best-of-k are one row for grpo: search.prompt_mode is auto and the route task" in table


def test_proposals_that_see_their_parents_keep_both_rows() -> None:
    solved = {"grpo": ["p0"], "vpo": ["p1"], "grpo/best_of_k": ["p0"], "vpo/best_of_k": ["p1"]}
    task = type("WithSearchPrompt", (), {"name": "code", "search_prompt": staticmethod(lambda *a: "")})()
    assert _parents_unseen("auto", task) is None and _parents_unseen("plain", task) == "search.prompt_mode is plain"
    table = _table(solved, None)
    assert "| grpo/best_of_k | 1/3" in table and "one row" not in table
