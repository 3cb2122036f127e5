"""Tests for vpo.search: database invariants, the search loop (resume, budget), baselines, curves.

The toy task: guess a hidden string; the reward has one dimension per character position
(1 if the character matches), positions beyond the target's length are absent (NaN). The
scripted proposer reads the first earlier attempt from the prompt and mutates it, so search
can climb where independent sampling cannot.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from vpo.rewards import VectorReward
from vpo.search import (
    ProgramDatabase,
    SearchResult,
    arm_curve,
    compare_arms,
    dominates,
    hardest_subset,
    niche_key,
    pareto_indices,
    plot_curves,
    run_arms,
    run_best_of_k,
    run_best_of_k_batch,
    run_search,
    run_search_batch,
    scalarize,
    search_curves,
)
from vpo.search.database import write_json
from vpo.search.loop import derive_seed
from vpo.search.runner import load_results
from vpo.tasks import Task

ALPHABET = "abcd"
MAXLEN = 8


class GuessReward(VectorReward):
    """Per-position match against row["target"]; positions past the target are absent."""

    names = tuple(f"pos{i}" for i in range(MAXLEN))

    def __init__(self) -> None:
        self.scored = 0
        self.calls = 0

    def present(self, row: Mapping[str, Any]) -> np.ndarray:
        return np.arange(MAXLEN) < len(row["target"])

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> np.ndarray:
        self.calls += 1
        self.scored += len(answers)
        target = row["target"]
        out = np.full((len(answers), MAXLEN), np.nan)
        for i, a in enumerate(answers):
            for j, ch in enumerate(target):
                out[i, j] = float(j < len(a) and a[j] == ch)
        return out


class GuessTask(Task):
    """Toy task: rows carry a hidden target string."""

    name = "guess"

    def __init__(self) -> None:
        self.reward = GuessReward()

    def load(self, split: str) -> list[dict[str, Any]]:
        rng = random.Random(split)
        return [
            {
                "id": f"g{i}",
                "prompt": f"Guess the hidden string #{i}.",
                "target": "".join(rng.choice(ALPHABET) for _ in range(6)),
            }
            for i in range(6)
        ]


class CustomPromptTask(GuessTask):
    """A task with its own search_prompt (records what it was given)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[Any]] = []

    def search_prompt(self, row: Mapping[str, Any], parents: list[Any], m: int) -> str:
        self.seen.append(list(parents))
        return self.format_prompt(row, m) + f"\nParent: <<{parents[0].text}>>"


_ATTEMPT = re.compile(r"(?:Attempt 1 \(overall score [0-9.]+\):\n```\n|Parent: <<)([a-d]*)")


class MutationProposer:
    """Deterministic in (prompt, seed): mutate the shown parent one position per answer, or
    guess at random when there is no parent."""

    def __init__(self, m: int, length: int = 6) -> None:
        self.m = m
        self.length = length
        self.calls = 0
        self.prompts: list[Any] = []

    def propose(self, prompts: Sequence[Any], seed: int) -> list[str]:
        self.calls += 1
        out = []
        for p in prompts:
            self.prompts.append(p)
            text = p if isinstance(p, str) else json.dumps(p)
            rng = random.Random(f"{seed}:{hashlib.sha256(text.encode()).hexdigest()}")
            match = _ATTEMPT.search(text)
            answers = []
            for _ in range(self.m):
                if match and match.group(1):
                    s = list(match.group(1))
                    s[rng.randrange(len(s))] = rng.choice(ALPHABET)
                    answers.append("".join(s))
                else:
                    answers.append("".join(rng.choice(ALPHABET) for _ in range(self.length)))
            out.append("".join(f"<answer_{i + 1}>{a}</answer_{i + 1}>" for i, a in enumerate(answers)))
        return out


class FixedProposer:
    """Always the same answers (to exercise the duplicate cache)."""

    def __init__(self, answers: Sequence[str]) -> None:
        self.answers = list(answers)
        self.calls = 0

    def propose(self, prompts: Sequence[Any], seed: int) -> list[str]:
        self.calls += 1
        body = "".join(f"<answer_{i + 1}>{a}</answer_{i + 1}>" for i, a in enumerate(self.answers))
        return [body for _ in prompts]


class Crash(RuntimeError):
    pass


class CrashingProposer(MutationProposer):
    """A MutationProposer that dies on call number ``crash_at`` (1-based)."""

    def __init__(self, m: int, crash_at: int) -> None:
        super().__init__(m)
        self.crash_at = crash_at

    def propose(self, prompts: Sequence[Any], seed: int) -> list[str]:
        if self.calls + 1 == self.crash_at:
            raise Crash("simulated crash")
        return super().propose(prompts, seed)


W3 = np.full(3, 1 / 3)


# ---------------------------------------------------------------------- database


def test_niche_key_and_scalarize() -> None:
    assert niche_key([0.0, 0.05, 0.5, 0.999, 1.0, float("nan")], 10) == (0, 0, 5, 9, 9, None)
    assert niche_key([0.0, 0.49, 0.5, 1.0], 2) == (0, 0, 1, 1)
    with pytest.raises(ValueError):
        niche_key([0.5], 0)
    assert scalarize([1.0, 0.0, float("nan")], [0.5, 0.25, 0.25]) == pytest.approx(0.5 / 0.75)
    assert scalarize([float("nan")] * 2, [0.5, 0.5]) == 0.0
    assert scalarize([1.0, 1.0], [0.5, 0.5]) == 1.0


def test_elitism_tie_breaks() -> None:
    db = ProgramDatabase(W3, num_islands=1, bins=2)
    a = db.add("aaaa", [1, 0, 0], island=0)
    assert a.inserted and a.new_niche
    worse = db.add("b", [0.9, 0, 0], island=0)  # same niche (bins=2), lower score
    assert not worse.inserted and db.islands[0][a.program.niche] == a.program.id
    assert worse.program.id not in db.programs
    longer = db.add("aaaaa", [1, 0, 0], island=0)
    assert not longer.inserted
    same_len = db.add("cccc", [1, 0, 0], island=0)
    assert not same_len.inserted  # exact tie keeps the incumbent
    shorter = db.add("cc", [1, 0, 0], island=0)
    assert shorter.inserted and shorter.replaced_id == a.program.id
    assert a.program.id not in db.programs  # displaced and unreferenced -> collected
    better = db.add("zzzzzzzz", [0.9, 0.4, 0.0], island=0)  # niche (1,0,0), higher score
    assert better.inserted and db.best().id == better.program.id


def test_niche_never_loses_its_best_random() -> None:
    rng = np.random.default_rng(0)
    db = ProgramDatabase(W3, num_islands=3, bins=2, migration_interval=7, seed=1)
    best_seen: dict[tuple[int, Any], tuple[float, int]] = {}
    for step in range(400):
        vec = rng.choice([0.0, 0.3, 0.6, 1.0], size=3)
        if rng.random() < 0.1:
            vec[2] = np.nan
        island = int(rng.integers(3))
        text = "x" * int(rng.integers(1, 9))
        res = db.add(text, vec, island=island, iteration=step)
        key = (island, res.program.niche)
        cand = (res.program.score, -len(text))
        if key not in best_seen or cand > best_seen[key]:
            best_seen[key] = cand
        if db.maybe_migrate(step + 1):
            for isl in range(3):
                for prog in db.elites(isl):
                    k = (isl, prog.niche)
                    best_seen[k] = max(best_seen.get(k, (-1.0, 0)), (prog.score, -len(prog.text)))
        for (isl, niche), (score, neglen) in best_seen.items():
            elite = db.programs[db.islands[isl][niche]]
            assert elite.niche == niche
            assert (elite.score, -len(elite.text)) == (score, neglen)
    # every stored program is referenced by some island, every niche key matches its program
    referenced = {pid for isl in db.islands for pid in isl.values()}
    assert referenced == set(db.programs)


def test_pareto_front_hand_made() -> None:
    nan = float("nan")
    vecs = [
        [1.0, 0.0, 0.0],  # 0 front
        [0.0, 1.0, 0.0],  # 1 front
        [0.5, 0.5, 0.5],  # 2 front
        [0.4, 0.4, 0.4],  # 3 dominated by 2
        [1.0, 0.0, nan],  # 4 dominated by 0 (NaN is worse than present)
        [0.0, 0.0, 1.0],  # 5 front
        [0.0, 0.0, 0.0],  # 6 dominated
    ]
    assert pareto_indices(vecs) == [0, 1, 2, 5]
    assert dominates(vecs[2], vecs[3]) and not dominates(vecs[3], vecs[2])
    assert not dominates(vecs[0], vecs[0])
    assert dominates(vecs[0], vecs[4])
    db = ProgramDatabase(W3, num_islands=2, bins=10)
    for i, v in enumerate(vecs):
        db.add(f"p{i}", v, island=i % 2)
    assert sorted(p.text for p in db.pareto_front()) == ["p0", "p1", "p2", "p5"]
    # island 0 holds p0, p2, p4, p6: p4 is dominated by p0, p6 by everything
    assert sorted(p.text for p in db.pareto_front(0)) == ["p0", "p2"]
    # island 1 holds p1, p3, p5: p3 = (.4,.4,.4) is dominated by neither p1 nor p5
    assert sorted(p.text for p in db.pareto_front(1)) == ["p1", "p3", "p5"]


def test_pareto_front_matches_brute_force() -> None:
    rng = np.random.default_rng(3)
    for _ in range(30):
        vecs = rng.choice([0.0, 0.5, 1.0], size=(12, 3)).tolist()
        front = set(pareto_indices(vecs))
        for i, v in enumerate(vecs):
            dominated = any(dominates(u, v) for j, u in enumerate(vecs) if j != i)
            assert (i in front) == (not dominated)


def test_migration_ring_snapshot() -> None:
    db = ProgramDatabase(W3, num_islands=3, bins=10, migration_rate=0.5, migration_interval=5)
    best0 = db.add("a", [1.0, 1.0, 0.0], island=0).program
    db.add("b", [0.1, 0.0, 0.0], island=0)
    best1 = db.add("c", [0.5, 0.5, 0.5], island=1).program
    best2 = db.add("d", [0.0, 0.0, 0.3], island=2).program
    assert db.maybe_migrate(4) == 0
    before = {i: {p.id for p in db.elites(i)} for i in range(3)}
    accepted = db.maybe_migrate(5)
    assert accepted == 3
    after = {i: {p.id for p in db.elites(i)} for i in range(3)}
    assert best0.id in after[1] and best1.id in after[2] and best2.id in after[0]
    assert best0.id not in after[2]  # snapshot: one hop per migration
    for i in range(3):
        assert before[i] <= after[i]  # sources keep their programs (copies move)
    # a copy shares the program object, so both islands rank it identically
    assert db.best(1).id == best0.id
    # migration respects niche elitism: an equal-niche better program is not displaced
    db2 = ProgramDatabase(W3, num_islands=2, bins=2)
    db2.add("long-program", [1.0, 0.0, 0.0], island=0)
    short = db2.add("s", [1.0, 0.0, 0.0], island=1).program
    db2.migrate()
    assert db2.islands[1][short.niche] == short.id
    assert db2.islands[0][short.niche] == short.id  # shorter copy wins the tie on island 0


def test_sampling_and_serialisation_roundtrip(tmp_path: Any) -> None:
    db = ProgramDatabase(W3, num_islands=2, bins=4, num_inspirations=2, seed=7)
    assert db.sample(0) == (None, [])
    rng = np.random.default_rng(5)
    for i in range(40):
        db.add(f"p{i}" + "x" * (i % 5), rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=3), island=i % 2)
    for _ in range(50):
        parent, insp = db.sample(1)
        assert parent is not None and parent.id in db.islands[1].values()
        ids = [p.id for p in insp]
        assert parent.id not in ids and len(set(ids)) == len(ids) <= 2
        assert all(i in db.islands[1].values() for i in ids)
    path = tmp_path / "db.json"
    db.save(path)
    clone = ProgramDatabase.load(path)
    assert json.dumps(clone.to_dict(), sort_keys=True) == json.dumps(db.to_dict(), sort_keys=True)

    def trace(d: ProgramDatabase) -> list[tuple[int, list[int]]]:
        out = []
        for i in range(30):
            parent, insp = d.sample(i % 2)
            assert parent is not None
            out.append((parent.id, [p.id for p in insp]))
        return out

    assert trace(db) == trace(clone)
    exploit = ProgramDatabase.from_dict(
        {**db.to_dict(), "options": {**db.options(), "exploration_ratio": 0.0, "exploitation_ratio": 1.0}}
    )
    front = {p.id for p in exploit.pareto_front(0)}
    assert all(exploit.sample_parent(0).id in front for _ in range(30))


# ---------------------------------------------------------------------- loop


def _rows(n: int = 2) -> list[dict[str, Any]]:
    return GuessTask().load("test")[:n]


def test_search_uses_parents_and_records_history() -> None:
    task = GuessTask()
    prop = MutationProposer(m=3)
    row = _rows(1)[0]
    res = run_search(
        row,
        task,
        prop,
        iterations=8,
        m=3,
        seed=0,
        prompt_mode="parents",
        stop_when_solved=False,
        db_options={"num_islands": 2},
    )
    assert res.iterations == 8 and res.candidates == sum(h["new"] for h in res.history) > 0
    assert len(res.history) == 9 and res.history[0]["candidates"] == 0
    # the first visit of each island has no parent; later prompts show one
    assert "Earlier attempts" not in prop.prompts[0] and "Earlier attempts" not in prop.prompts[1]
    assert all("Earlier attempts" in p for p in prop.prompts[2:])
    assert all(p.rstrip().endswith("Later answers should differ from earlier ones.") for p in prop.prompts)
    best = [h["best_score"] for h in res.history]
    assert best == sorted(best)  # best-so-far is monotone
    assert res.best_score == pytest.approx(max(s for h in res.history for s in h["scores"]))
    # auto mode with a task lacking search_prompt: plain prompts only
    prop2 = MutationProposer(m=3)
    run_search(row, GuessTask(), prop2, iterations=4, m=3, seed=0, prompt_mode="auto")
    assert not any("Earlier attempts" in p for p in prop2.prompts)
    # a task's own search_prompt is used, with parents[0] the sampled parent
    ctask = CustomPromptTask()
    prop3 = MutationProposer(m=2)
    run_search(
        row, ctask, prop3, iterations=6, m=2, seed=0, db_options={"num_islands": 1}, stop_when_solved=False
    )
    assert len(ctask.seen) == 5
    for ps in ctask.seen:  # parents are Programs with text, vector and score
        assert ps and all(len(p.vector) == MAXLEN and 0.0 <= p.score <= 1.0 for p in ps)
    assert all("Parent: <<" in p for p in prop3.prompts[1:])


def test_search_solves_and_beats_best_of_k() -> None:
    task = GuessTask()
    rows = task.load("test")
    search = run_search_batch(
        rows,
        task,
        MutationProposer(m=3),
        iterations=80,
        m=3,
        seed=1,
        prompt_mode="parents",
        db_options={"num_islands": 2},
    )
    bok = run_best_of_k_batch(rows, GuessTask(), MutationProposer(m=3), budget=240, m=3, seed=1)
    n_search = sum(r.solved for r in search)
    n_bok = sum(r.solved for r in bok)
    assert n_search >= 5 and n_search >= n_bok + 3
    for r in search:
        if r.solved:
            assert (
                r.best_score == 1.0
                and r.best_text == next(x for x in rows if x["id"] == r.problem_id)["target"]
            )
            assert r.history[-1]["solved"] and r.solved_at_iteration == r.iterations  # stopped when solved
            assert r.solved_at_candidates <= r.candidates


def test_is_solved_hook() -> None:
    class Lenient(GuessTask):
        def is_solved(self, vector: np.ndarray) -> bool:
            return bool(np.nansum(vector) >= 2)

    class WithRow(GuessTask):
        def is_solved(self, vector: np.ndarray, row: Mapping[str, Any]) -> bool:
            assert row["id"] == "g0"
            return bool(vector[0] == 1.0 and vector[1] == 1.0)

    class Capped(GuessTask):
        def best_scalar(self, row: Mapping[str, Any]) -> float:
            return 4 / 6

    row = _rows(1)[0]
    res = run_search(row, Lenient(), MutationProposer(m=3), iterations=30, m=3, seed=0)
    assert res.solved and res.best_score < 1.0 and res.iterations < 30
    vec = np.array([np.nan if x is None else x for x in res.solution_vector])
    assert np.nansum(vec) >= 2
    res = run_search(row, WithRow(), MutationProposer(m=3), iterations=30, m=3, seed=0, prompt_mode="parents")
    assert res.solved and res.solution_vector[:2] == [1.0, 1.0] and res.solution_text[:2] == row["target"][:2]
    res = run_search(row, Capped(), MutationProposer(m=3), iterations=30, m=3, seed=0, prompt_mode="parents")
    assert res.solved and res.best_score == pytest.approx(4 / 6) and res.iterations < 30
    not_reached = run_search(row, Capped(), FixedProposer(["dddddd"]), iterations=3, m=1, seed=0)
    assert not not_reached.solved and not_reached.iterations == 3


def _full(results: Sequence[SearchResult]) -> list[dict[str, Any]]:
    return [r.to_dict(include_database=True) for r in results]


def test_resume_after_crash_equals_uninterrupted(tmp_path: Any) -> None:
    rows = _rows(2)
    kw: dict[str, Any] = {
        "iterations": 12,
        "m": 3,
        "seed": 5,
        "checkpoint_every": 3,
        "prompt_mode": "parents",
        "stop_when_solved": False,
        "db_options": {"num_islands": 3, "migration_interval": 4},
    }
    ref = run_search_batch(
        rows, GuessTask(), MutationProposer(m=3), checkpoint_path=tmp_path / "a.json", **kw
    )
    ckpt = tmp_path / "b.json"
    with pytest.raises(Crash):
        run_search_batch(rows, GuessTask(), CrashingProposer(m=3, crash_at=8), checkpoint_path=ckpt, **kw)
    assert json.loads(ckpt.read_text())["step"] == 6
    resumed_prop = MutationProposer(m=3)
    got = run_search_batch(rows, GuessTask(), resumed_prop, checkpoint_path=ckpt, **kw)
    assert resumed_prop.calls == 12 - 6  # really resumed, not restarted
    assert _full(got) == _full(ref)
    assert search_curves({"x": got}) == search_curves({"x": ref})
    # the uninterrupted run also equals a run without any checkpointing
    plain = run_search_batch(rows, GuessTask(), MutationProposer(m=3), **kw)
    assert _full(plain) == _full(ref)
    # a finished checkpoint returns immediately without calling the proposer
    idle = FixedProposer(["zz"])
    again = run_search_batch(rows, GuessTask(), idle, checkpoint_path=ckpt, **kw)
    assert idle.calls == 0 and _full(again) == _full(ref)
    # extending the iteration budget continues from the checkpoint
    longer = run_search_batch(
        rows, GuessTask(), MutationProposer(m=3), checkpoint_path=ckpt, **{**kw, "iterations": 14}
    )
    assert all(r.iterations == 14 for r in longer)
    assert [h for h in longer[0].history[:13]] == ref[0].history


def test_checkpoint_from_another_search_is_refused(tmp_path: Any) -> None:
    ckpt = tmp_path / "c.json"
    run_search(
        _rows(1)[0], GuessTask(), MutationProposer(m=2), iterations=2, m=2, seed=0, checkpoint_path=ckpt
    )
    with pytest.raises(ValueError, match="different search"):
        run_search(
            _rows(1)[0], GuessTask(), MutationProposer(m=2), iterations=2, m=2, seed=1, checkpoint_path=ckpt
        )


@pytest.mark.parametrize("m,budget", [(3, 10), (4, 4), (5, 7), (1, 3)])
def test_budget_never_exceeded(m: int, budget: int) -> None:
    task = GuessTask()
    res = run_search(
        _rows(1)[0],
        task,
        MutationProposer(m=m),
        iterations=100,
        m=m,
        seed=2,
        budget=budget,
        stop_when_solved=False,
        prompt_mode="parents",
    )
    assert res.candidates == budget
    assert task.reward.scored <= budget
    assert sum(h["new"] for h in res.history) == sum(len(h["scores"]) for h in res.history) == budget
    assert res.iterations == math.ceil(budget / m)
    assert res.history[-1]["new"] == budget - m * (res.iterations - 1)


def test_duplicates_count_against_budget_but_are_not_rescored() -> None:
    task = GuessTask()
    res = run_search(
        _rows(1)[0],
        task,
        FixedProposer(["abab", "abab ", "cccc", "dddd"]),
        iterations=50,
        m=4,
        seed=0,
        budget=11,
        stop_when_solved=False,
    )
    # "abab" and "abab " share a dedup key: 3 distinct candidates per call
    assert [h["new"] for h in res.history[1:]] == [3, 3, 3, 2]
    assert res.candidates == 11 and task.reward.scored == 3 and res.duplicates == 8


def test_best_of_k_same_budget_and_plain_prompts() -> None:
    task = GuessTask()
    prop = MutationProposer(m=3)
    res = run_best_of_k(_rows(1)[0], task, prop, budget=10, m=3, seed=0, stop_when_solved=False)
    assert res.candidates == 10 and prop.calls == 4 and res.iterations == 4
    assert task.reward.scored <= 10
    assert not any("Earlier attempts" in p for p in prop.prompts)
    single = run_best_of_k(
        _rows(1)[0], GuessTask(), MutationProposer(m=1), budget=5, m=1, seed=0, stop_when_solved=False
    )
    assert single.candidates == 5 and single.iterations == 5


def test_initial_programs_seed_every_island() -> None:
    task = GuessTask()
    row = _rows(1)[0]
    res = run_search(
        row,
        task,
        MutationProposer(m=2),
        iterations=3,
        m=2,
        seed=0,
        prompt_mode="parents",
        initial_programs=lambda r: ["aaaaaa"],
        db_options={"num_islands": 3},
        stop_when_solved=False,
    )
    assert res.history[0]["candidates"] == 0 and res.candidates == 6
    assert res.history[0]["best_score"] == pytest.approx(sum(c == "a" for c in row["target"]) / 6)


# ---------------------------------------------------------------------- curves


def _result(
    pid: str, hist: list[tuple[int, float, bool, list[float]]], budget: int, max_it: int
) -> dict[str, Any]:
    history = [
        {"iteration": i, "candidates": c, "best_score": b, "solved": s, "scores": sc}
        for i, (c, b, s, sc) in enumerate(hist)
    ]
    solved_c = next((None if not h["solved"] else h["candidates"] for h in history if h["solved"]), None)
    return {
        "problem_id": pid,
        "budget": budget,
        "max_iterations": max_it,
        "candidates": hist[-1][0],
        "best_score": hist[-1][1],
        "solved": hist[-1][2],
        "solved_at_candidates": solved_c,
        "history": history,
    }


def test_curves_carry_forward_and_compare(tmp_path: Any) -> None:
    a1 = _result("p1", [(0, 0, False, []), (2, 0.5, False, [0.5, 0.2]), (4, 1.0, True, [0.1, 1.0])], 6, 3)
    a2 = _result(
        "p2",
        [(0, 0, False, []), (2, 0.2, False, [0.2, 0.0]), (4, 0.2, False, [0, 0]), (6, 0.4, False, [0.4, 0])],
        6,
        3,
    )
    b1 = _result(
        "p1",
        [
            (0, 0, False, []),
            (2, 0.3, False, [0.3, 0.1]),
            (4, 0.3, False, [0.0, 0.0]),
            (6, 0.3, False, [0.0, 0.0]),
        ],
        6,
        3,
    )
    b2 = _result("p2", [(0, 0, False, []), (2, 1.0, True, [0.0, 1.0])], 6, 3)
    curves = search_curves({"a": [a1, a2], "b": [b1, b2]})
    ca, cb = curves["a"], curves["b"]
    assert ca["iterations"] == [0, 1, 2, 3]
    assert ca["solved_by_iteration"] == [0, 0, 1, 1]
    assert ca["mean_best_by_iteration"] == pytest.approx([0, 0.35, 0.6, 0.7])
    assert ca["candidates"] == list(range(7))
    assert ca["solved_by_candidates"] == [0, 0, 0, 0, 1, 1, 1]
    # per-candidate running max: p1 = 0,.5,.5,.5,1,1,1 ; p2 = 0,.2,.2,.2,.2,.4,.4
    assert ca["mean_best_by_candidates"] == pytest.approx([0, 0.35, 0.35, 0.35, 0.6, 0.7, 0.7])
    assert cb["solved_by_candidates"] == [0, 0, 1, 1, 1, 1, 1]
    assert cb["mean_best_by_candidates"] == pytest.approx([0, 0.15, 0.65, 0.65, 0.65, 0.65, 0.65])
    cmp = compare_arms(ca, cb)
    assert cmp["a_only"] == ["p1"] and cmp["b_only"] == ["p2"] and cmp["both"] == [] and cmp["neither"] == []
    assert cmp["n_a_only"] == 1 and cmp["n_problems"] == 2
    png = plot_curves(curves, tmp_path / "c.png", title="toy")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    with pytest.raises(ValueError):
        arm_curve([])


def test_hardest_subset_formats() -> None:
    per_arm = {
        "grpo": {"p1": 0.0, "p2": 1.0, "p3": 0.5, "p4": 0.2, "p5": 0.0},
        "vpo": {"p1": 0.1, "p2": 0.9, "p3": 1.0, "p4": 0.0},
    }
    assert hardest_subset(per_arm, k=30) == ["p1", "p4"]  # p5 not evaluated by every arm
    assert hardest_subset(per_arm, k=30, limit=1) == ["p1"]
    nested = {arm: {pid: {"best@30": v, "best@1": 0.0} for pid, v in d.items()} for arm, d in per_arm.items()}
    assert hardest_subset(nested, k=30) == ["p1", "p4"]
    assert hardest_subset(nested, k=1) == ["p1", "p2", "p3", "p4"]
    records = [{"arm": a, "problem_id": p, "best@30": v} for a, d in per_arm.items() for p, v in d.items()]
    assert hardest_subset(records, k=30) == ["p1", "p4"]
    with pytest.raises(ValueError):
        hardest_subset([{"arm": "x", "id": "p"}], k=30)


def test_run_arms_writes_everything_and_resumes(tmp_path: Any) -> None:
    task = GuessTask()
    rows = task.load("test")[:3]
    out = run_arms(
        task,
        rows,
        {"grpo": MutationProposer(m=3), "vpo": MutationProposer(m=3)},
        tmp_path,
        iterations=6,
        m=3,
        seed=0,
        prompt_mode="parents",
        checkpoint_every=2,
    )
    assert set(out["results"]) == {"grpo", "grpo/best_of_k", "vpo", "vpo/best_of_k"}
    for key in ("results", "curves", "comparison", "plot"):
        assert (tmp_path / out["paths"][key].split("/")[-1]).exists()
    comparison = json.loads((tmp_path / "comparison.json").read_text())
    assert set(comparison) == {"grpo vs vpo", "grpo vs grpo/best_of_k", "vpo vs vpo/best_of_k"}
    loaded = load_results(out["paths"]["results"])
    assert [r.to_dict() for r in loaded["vpo"]] == [r.to_dict() for r in out["results"]["vpo"]]
    idle = FixedProposer(["x"])
    again = run_arms(
        task,
        rows,
        {"grpo": idle, "vpo": idle},
        tmp_path,
        iterations=6,
        m=3,
        seed=0,
        prompt_mode="parents",
        checkpoint_every=2,
    )
    assert idle.calls == 0 and again["curves"] == out["curves"]


def test_derive_seed_is_stable() -> None:
    assert derive_seed(0, "propose", 3) == derive_seed(0, "propose", 3)
    assert derive_seed(0, "propose", 3) != derive_seed(0, "propose", 4)
    assert 0 <= derive_seed(123, "db", "x") < 2**31


def test_search_table_pairs_grow_linearly_with_the_reference_arm_on_the_left() -> None:
    """With n arms the table shows n-1 pairs against the reference (VPO) arm plus one search-vs-best-of-k
    pair per arm, the reference always on the left with its own counts; comparison.json keeps all pairs."""
    from vpo.pipeline.stages.search import search_table
    from vpo.search.curves import compare_arms

    ids = ["p0", "p1", "p2"]
    solved = {"grpo": ["p0"], "vpo": ["p1", "p2"], "x3": [], "mk": ["p0", "p1"]}
    solved |= {f"{a}/best_of_k": s[:1] for a, s in list(solved.items())}
    curves = {a: {"n_problems": 3, "problem_ids": ids, "solved_ids": s, "final_solved": len(s),
                  "final_mean_best": 0.5, "candidates_used": 9} for a, s in solved.items()}
    plain = ["grpo", "vpo", "x3", "mk"]
    comparison = {f"{a} vs {b}": compare_arms(curves[a], curves[b])
                  for i, a in enumerate(plain) for b in plain[i + 1:]}
    comparison |= {f"{a} vs {a}/best_of_k": compare_arms(curves[a], curves[f"{a}/best_of_k"]) for a in plain}
    table = search_table(curves, comparison, ["p2"], 5, reference="vpo")
    rows = [ln for ln in table.splitlines() if " vs " in ln and "(a vs b)" not in ln]
    assert len(rows) == 3 + 4 and len(comparison) == 6 + 4
    assert "| vpo vs grpo | 2 | 1 | 0 | 0 |" in rows  # swapped: vpo alone solves p1, p2; grpo alone p0
    assert "| vpo vs mk | 1 | 1 | 1 | 0 |" in rows and not any(r.startswith("| grpo vs x3") for r in rows)
    assert "| vpo vs vpo/best_of_k | 1 | 0 | 1 | 1 |" in rows


def test_search_json_is_compact_ordered_strict_and_atomic(tmp_path: Any) -> None:
    """The search writes JSON through vpo.atomic: keys in the order given (arms stay in run order),
    compact, and a NaN is refused with the old file intact and no temporary left behind."""
    path = tmp_path / "out" / "results.json"
    write_json(path, {"vpo": [1.5], "grpo": None})
    assert path.read_text() == '{"vpo": [1.5], "grpo": null}\n'
    with pytest.raises(ValueError, match="Out of range float"):
        write_json(path, {"vpo": [float("nan")]})
    assert json.loads(path.read_text()) == {"vpo": [1.5], "grpo": None}
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]
