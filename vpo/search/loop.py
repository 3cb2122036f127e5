"""The evolutionary search loop: a policy checkpoint as the proposal operator.

Each iteration, for each problem still searching:

1. pick the island ``iteration % num_islands`` and sample a parent plus inspirations from it;
2. build a prompt: ``task.search_prompt(row, parents, m)`` when the task defines one (``parents``
   is ``[parent, *inspirations]``, a list of :class:`~vpo.search.database.Program`), otherwise
   the plain ``task.format_prompt(row, m)``. Small models that were never trained on
   parent-conditioned prompts should get the plain prompt (``prompt_mode="plain"`` or
   ``"auto"`` with a task without ``search_prompt``); the search then still keeps the niche
   archive but its proposals are independent samples, i.e. it behaves like best-of-k.
   ``prompt_mode="parents"`` uses :func:`parent_prompt`, a generic prompt that shows the
   parents and their per-dimension results, for tasks without their own ``search_prompt``;
3. ask the proposer for ONE completion holding up to m candidates;
4. parse (``reward.parse``), de-duplicate within the completion (``reward.dedup_key``), cut to
   the remaining candidate budget, score (``reward.score``, checked like
   :func:`vpo.rewards.score_set`) and insert every candidate into the database;
5. record the best scalar score so far and whether the problem is solved (see
   :func:`solved_checker`: ``task.is_solved(vector[, row])`` if defined, else reaching
   ``task.best_scalar(row)`` if defined, else scalar == 1.0).

All problems of a call advance in lockstep so a batched proposer (one call per iteration for
all problems) is used efficiently. Every ``checkpoint_every`` iterations the whole state (each
problem's database with its RNG, counters, history and score cache) is written atomically to
``checkpoint_path``; a run started again with the same arguments resumes from it and produces
exactly the result an uninterrupted run would have, given a proposer that is deterministic in
(prompts, seed). Proposer seeds depend only on (seed, iteration).

Budget: a candidate is one distinct answer of one completion. A problem never gets more than
``budget`` candidates scored; the last completion is truncated if needed. Candidates already
seen in an earlier iteration count against the budget (the proposer spent them) but are not
re-scored (a cache keyed by ``dedup_key``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vpo.rewards import validate_reward_matrix
from vpo.search.database import Program, ProgramDatabase, write_json
from vpo.search.proposer import Prompt, Proposer, ProposerError

__all__ = [
    "PROMPT_MODES",
    "SearchResult",
    "derive_seed",
    "format_attempts",
    "parent_prompt",
    "run_search",
    "run_search_batch",
    "solved_checker",
]

PROMPT_MODES = ("auto", "parents", "plain")
_CKPT_VERSION = 1
SOLVED_TOL = 1e-9


def derive_seed(seed: int, *parts: Any) -> int:
    """A stable 31-bit seed from ``seed`` and labels (independent of PYTHONHASHSEED)."""
    h = hashlib.sha256(json.dumps([int(seed), *[str(p) for p in parts]]).encode("utf-8")).digest()
    return int.from_bytes(h[:4], "big") & 0x7FFFFFFF


def _nan_list(v: Sequence[float]) -> list[float | None]:
    return [None if math.isnan(float(x)) else float(x) for x in v]


def _from_nan_list(v: Sequence[float | None]) -> tuple[float, ...]:
    return tuple(float("nan") if x is None else float(x) for x in v)


@dataclass
class SearchResult:
    """Outcome of searching one problem with one arm.

    ``history[0]`` is the state before the first iteration; ``history[t]`` after iteration t,
    with cumulative ``candidates``, ``best_score`` so far, ``solved`` so far and ``scores``, the
    scalar score of each candidate of that iteration in evaluation order. ``max_iterations`` is
    the configured iteration cap, ``iterations`` the number actually run.
    """

    problem_id: str
    arm: str
    seed: int
    m: int
    budget: int
    max_iterations: int
    iterations: int
    candidates: int
    best_score: float
    best_vector: list[float | None] | None
    best_text: str | None
    solved: bool
    solved_at_iteration: int | None
    solved_at_candidates: int | None
    history: list[dict[str, Any]]
    solution_text: str | None = None
    solution_vector: list[float | None] | None = None
    duplicates: int = 0
    pareto_size: int = 0
    n_programs: int = 0
    database: ProgramDatabase | None = field(default=None, repr=False, compare=False)

    def to_dict(self, include_database: bool = False) -> dict[str, Any]:
        """JSON-ready dict; the database only when asked (it can be large)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "database"}
        d["history"] = [dict(h) for h in self.history]
        if include_database and self.database is not None:
            d["database"] = self.database.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SearchResult:
        """Inverse of :meth:`to_dict`."""
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "database"}
        db = ProgramDatabase.from_dict(d["database"]) if d.get("database") else None
        return cls(**kw, database=db)


# ---------------------------------------------------------------------- prompts


def format_attempts(reward: Any, parents: Sequence[Program], max_dims: int = 12) -> str:
    """Text block showing earlier attempts and their per-dimension results."""
    names = list(getattr(reward, "names", ())) or [f"d{i}" for i in range(len(parents[0].vector))]
    lines = [
        "Earlier attempts at this problem and how they scored (each check from 0.0 = worst to 1.0 = best):"
    ]
    for n, p in enumerate(parents, start=1):
        lines.append("")
        lines.append(f"Attempt {n} (overall score {p.score:.3f}):")
        lines.append("```")
        lines.append(p.text)
        lines.append("```")
        present = [(names[i], v) for i, v in enumerate(p.vector) if not math.isnan(v)]
        if len(present) <= max_dims:
            lines.append("Checks: " + ", ".join(f"{nm}={v:.2f}" for nm, v in present))
        else:
            failed = [nm for nm, v in present if v < 1.0 - SOLVED_TOL]
            shown = ", ".join(failed[:max_dims]) + (" ..." if len(failed) > max_dims else "")
            lines.append(
                f"Fully passed {len(present) - len(failed)}/{len(present)} checks"
                + (f"; not passed: {shown}" if failed else "")
            )
    lines.append("")
    lines.append("Write new answers that keep what these attempts get right and fix what they get wrong.")
    return "\n".join(lines)


def parent_prompt(task: Any, row: Mapping[str, Any], parents: Sequence[Program], m: int) -> Prompt:
    """The task's own prompt with :func:`format_attempts` added to the problem text (the last
    user message for chat prompts), then formatted by ``task.format_prompt(row, m)`` so the
    task's m-answer instruction stays last."""
    if not parents:
        return task.format_prompt(row, m)
    block = format_attempts(task.reward, parents)
    base = row["prompt"]
    if isinstance(base, str):
        new: Any = f"{base.rstrip()}\n\n{block}"
    else:
        new = [dict(msg) for msg in base]
        for msg in reversed(new):
            if msg.get("role") == "user":
                msg["content"] = f"{str(msg.get('content', '')).rstrip()}\n\n{block}"
                break
        else:
            raise ValueError("chat prompt has no user message to attach the attempts to")
    return task.format_prompt({**row, "prompt": new}, m)


def _build_prompt(task: Any, row: Mapping[str, Any], parents: list[Program], m: int, mode: str) -> Prompt:
    if mode == "plain" or not parents:
        return task.format_prompt(row, m)
    custom = getattr(task, "search_prompt", None)
    if callable(custom):
        return custom(row, parents, m)
    if mode == "parents":
        return parent_prompt(task, row, parents, m)
    return task.format_prompt(row, m)


# ---------------------------------------------------------------------- per-problem state


def _key_hash(key: Any) -> str:
    return hashlib.sha256(repr(key).encode("utf-8")).hexdigest()[:32]


SolvedFn = Callable[[Sequence[float], float], bool]


def _positional_arity(fn: Callable[..., Any]) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return 2
    return sum(p.kind in kinds for p in params)


def solved_checker(task: Any, row: Mapping[str, Any]) -> SolvedFn:
    """When a candidate counts as solving ``row``: ``task.is_solved(vector)`` or
    ``task.is_solved(vector, row)`` if the task defines it; else reaching ``task.best_scalar(row)``
    (the best achievable scalar, for tasks whose optimum is below 1); else scalar == 1.0."""
    fn = getattr(task, "is_solved", None)
    if callable(fn):
        with_row = _positional_arity(fn) >= 2
        return lambda v, s: bool(
            fn(np.asarray(v, dtype=np.float64), row) if with_row else fn(np.asarray(v, dtype=np.float64))
        )
    best = getattr(task, "best_scalar", None)
    target = float(best(row)) if callable(best) else 1.0
    return lambda v, s: s >= target - SOLVED_TOL


class _ProblemState:
    """Search state of one problem: database, counters, history, score cache."""

    def __init__(self, row: Mapping[str, Any], db: ProgramDatabase, is_solved: SolvedFn) -> None:
        self.row = row
        self.is_solved = is_solved
        self.pid = str(row["id"])
        self.db = db
        self.iteration = 0
        self.candidates = 0
        self.duplicates = 0
        self.best: dict[str, Any] | None = None  # {"text", "vector", "score"}
        self.solved_at: tuple[int, int] | None = None
        self.solution: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []
        self.cache: dict[str, list[float | None]] = {}
        self.pending: tuple[int, Program | None] | None = None

    @property
    def best_score(self) -> float:
        return 0.0 if self.best is None else float(self.best["score"])

    def done(self, iterations: int, budget: int, stop_when_solved: bool) -> bool:
        return (
            self.iteration >= iterations
            or self.candidates >= budget
            or (stop_when_solved and self.solved_at is not None)
        )

    def offer_best(self, text: str, vector: Sequence[float], score: float) -> None:
        better = (
            self.best is None
            or score > self.best["score"]
            or (score == self.best["score"] and len(text) < len(self.best["text"]))
        )
        if better:
            self.best = {"text": text, "vector": _nan_list(vector), "score": float(score)}
        if self.solved_at is None and self.is_solved(vector, score):
            self.solved_at = (self.iteration, self.candidates)
            self.solution = {"text": text, "vector": _nan_list(vector), "score": float(score)}

    def record(self, **extra: Any) -> None:
        self.history.append(
            {
                "iteration": self.iteration,
                "candidates": self.candidates,
                "best_score": self.best_score,
                "solved": self.solved_at is not None,
                **extra,
            }
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "problem_id": self.pid,
            "db": self.db.to_dict(),
            "iteration": self.iteration,
            "candidates": self.candidates,
            "duplicates": self.duplicates,
            "best": self.best,
            "solved_at": None if self.solved_at is None else list(self.solved_at),
            "solution": self.solution,
            "history": self.history,
            "cache": self.cache,
        }

    @classmethod
    def from_dict(cls, row: Mapping[str, Any], d: Mapping[str, Any], is_solved: SolvedFn) -> _ProblemState:
        st = cls(row, ProgramDatabase.from_dict(d["db"]), is_solved)
        if st.pid != d["problem_id"]:
            raise ValueError(f"checkpoint problem {d['problem_id']!r} does not match row {st.pid!r}")
        st.iteration = int(d["iteration"])
        st.candidates = int(d["candidates"])
        st.duplicates = int(d.get("duplicates", 0))
        st.best = d["best"]
        st.solved_at = None if d["solved_at"] is None else (int(d["solved_at"][0]), int(d["solved_at"][1]))
        st.solution = d.get("solution")
        st.history = [dict(h) for h in d["history"]]
        st.cache = {str(k): list(v) for k, v in d["cache"].items()}
        return st

    def result(self, arm: str, seed: int, m: int, budget: int, max_iterations: int) -> SearchResult:
        best = self.best
        return SearchResult(
            problem_id=self.pid,
            arm=arm,
            seed=seed,
            m=m,
            budget=budget,
            max_iterations=max_iterations,
            iterations=self.iteration,
            candidates=self.candidates,
            best_score=self.best_score,
            best_vector=None if best is None else list(best["vector"]),
            best_text=None if best is None else str(best["text"]),
            solved=self.solved_at is not None,
            solved_at_iteration=None if self.solved_at is None else self.solved_at[0],
            solved_at_candidates=None if self.solved_at is None else self.solved_at[1],
            history=[dict(h) for h in self.history],
            solution_text=None if self.solution is None else str(self.solution["text"]),
            solution_vector=None if self.solution is None else list(self.solution["vector"]),
            duplicates=self.duplicates,
            pareto_size=len(self.db.pareto_front()),
            n_programs=len(self.db),
            database=self.db,
        )


# ---------------------------------------------------------------------- engine


def _score(task: Any, row: Mapping[str, Any], answers: list[str], pid: str) -> np.ndarray:
    reward = task.reward
    present = np.asarray(reward.present(row), dtype=bool)
    return validate_reward_matrix(
        reward.score(answers, row), len(answers), present, where=f"{type(reward).__name__} on {pid}"
    )


def _evaluate(task: Any, st: _ProblemState, answers: list[str]) -> list[tuple[float, ...]]:
    """Vectors for ``answers`` (scoring only those not in the cache)."""
    keys = [_key_hash(task.reward.dedup_key(a)) for a in answers]
    todo = [i for i, k in enumerate(keys) if k not in st.cache]
    st.duplicates += len(answers) - len(todo)
    if todo:
        mat = _score(task, st.row, [answers[i] for i in todo], st.pid)
        for i, vec in zip(todo, mat):
            st.cache[keys[i]] = _nan_list(vec)
    return [_from_nan_list(st.cache[k]) for k in keys]


def _init_state(
    task: Any,
    row: Mapping[str, Any],
    seed: int,
    db_options: Mapping[str, Any],
    initial_programs: Callable[[Mapping[str, Any]], Sequence[str]] | None,
) -> _ProblemState:
    pid = str(row["id"])
    db = ProgramDatabase(task.reward.w_star(), seed=derive_seed(seed, "db", pid), **db_options)
    st = _ProblemState(row, db, solved_checker(task, row))
    if initial_programs is not None:
        texts = [str(t) for t in initial_programs(row) if str(t).strip()]
        if texts:
            for text, vec in zip(texts, _evaluate(task, st, texts)):
                prog = db.add_everywhere(text, vec, iteration=0)
                st.offer_best(text, vec, prog.score)
            st.duplicates = 0
    st.record(new=0, inserted=0, scores=[])
    return st


def _propose_prompt(task: Any, st: _ProblemState, m: int, mode: str, use_parents: bool) -> Prompt:
    island = st.iteration % st.db.num_islands
    parent, insp = st.db.sample(island) if use_parents else (None, [])
    st.pending = (island, parent)
    parents = [parent, *insp] if parent is not None else []
    return _build_prompt(task, st.row, parents, m, mode if use_parents else "plain")


def _consume(task: Any, st: _ProblemState, completion: str, m: int, budget: int) -> None:
    assert st.pending is not None
    island, parent = st.pending
    st.pending = None
    reward = task.reward
    answers = [a for a in reward.parse(completion, m) if a.strip()][:m]
    seen: set[Any] = set()
    distinct: list[str] = []
    for a in answers:
        k = reward.dedup_key(a)
        if k not in seen:
            seen.add(k)
            distinct.append(a)
    distinct = distinct[: max(0, budget - st.candidates)]
    vectors = _evaluate(task, st, distinct) if distinct else []
    st.iteration += 1
    inserted = 0
    scores: list[float] = []
    for text, vec in zip(distinct, vectors):
        res = st.db.add(
            text, vec, island=island, parent_id=None if parent is None else parent.id, iteration=st.iteration
        )
        inserted += int(res.inserted)
        scores.append(res.program.score)
        st.candidates += 1
        st.offer_best(text, vec, res.program.score)
    st.db.maybe_migrate(st.iteration)
    st.record(
        new=len(distinct),
        inserted=inserted,
        scores=scores,
        island=island,
        parent_id=None if parent is None else parent.id,
    )


def _fingerprint(
    task: Any,
    rows: Sequence[Mapping[str, Any]],
    *,
    arm: str,
    seed: int,
    m: int,
    mode: str,
    stop_when_solved: bool,
    db_options: Mapping[str, Any],
    kind: str,
    has_initial: bool,
) -> dict[str, Any]:
    return {
        "kind": kind,
        "arm": arm,
        "seed": int(seed),
        "m": int(m),
        "prompt_mode": mode,
        "stop_when_solved": bool(stop_when_solved),
        "db_options": dict(sorted(db_options.items())),
        "problem_ids": [str(r["id"]) for r in rows],
        "reward": [type(task.reward).__name__, list(task.reward.names)],
        "initial_programs": has_initial,
    }


def _save(
    path: Path,
    fingerprint: dict[str, Any],
    step: int,
    states: list[_ProblemState],
    iterations: int,
    budget: int,
) -> None:
    write_json(
        path,
        {
            "version": _CKPT_VERSION,
            "fingerprint": fingerprint,
            "step": step,
            "iterations": iterations,
            "budget": budget,
            "problems": [s.to_dict() for s in states],
        },
    )


def _load(
    path: Path, fingerprint: dict[str, Any], rows: Sequence[Mapping[str, Any]], task: Any
) -> tuple[int, list[_ProblemState]]:
    with open(path, encoding="utf-8") as f:
        ck = json.load(f)
    if ck.get("version") != _CKPT_VERSION:
        raise ValueError(f"{path}: unsupported checkpoint version {ck.get('version')!r}")
    if ck["fingerprint"] != json.loads(json.dumps(fingerprint)):
        diff = sorted(
            k for k in fingerprint if ck["fingerprint"].get(k) != json.loads(json.dumps(fingerprint[k]))
        )
        raise ValueError(
            f"{path}: checkpoint belongs to a different search (differs in {diff}); "
            "delete it or use another checkpoint_path"
        )
    if len(ck["problems"]) != len(rows):
        raise ValueError(f"{path}: checkpoint has {len(ck['problems'])} problems, got {len(rows)} rows")
    states = [_ProblemState.from_dict(r, d, solved_checker(task, r)) for r, d in zip(rows, ck["problems"])]
    return int(ck["step"]), states


def _run(
    rows: Sequence[Mapping[str, Any]],
    task: Any,
    proposer: Proposer,
    *,
    iterations: int,
    m: int,
    seed: int,
    budget: int | None,
    checkpoint_path: str | os.PathLike[str] | None,
    checkpoint_every: int,
    arm: str,
    prompt_mode: str,
    stop_when_solved: bool,
    db_options: Mapping[str, Any] | None,
    initial_programs: Callable[[Mapping[str, Any]], Sequence[str]] | None,
    use_parents: bool,
    kind: str,
) -> list[SearchResult]:
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}")
    if prompt_mode not in PROMPT_MODES:
        raise ValueError(f"prompt_mode must be one of {PROMPT_MODES}, got {prompt_mode!r}")
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    budget = iterations * m if budget is None else int(budget)
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    ids = [str(r["id"]) for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError("problem ids must be unique within one search")
    opts = dict(db_options or {})
    opts.pop("seed", None)
    fp = _fingerprint(
        task,
        rows,
        arm=arm,
        seed=seed,
        m=m,
        mode=prompt_mode,
        stop_when_solved=stop_when_solved,
        db_options=opts,
        kind=kind,
        has_initial=initial_programs is not None,
    )
    ckpt = Path(checkpoint_path) if checkpoint_path is not None else None
    if ckpt is not None and ckpt.exists():
        step, states = _load(ckpt, fp, rows, task)
    else:
        step, states = 0, [_init_state(task, r, seed, opts, initial_programs) for r in rows]
    while True:
        active = [s for s in states if not s.done(iterations, budget, stop_when_solved)]
        if not active:
            break
        prompts = [_propose_prompt(task, s, m, prompt_mode, use_parents) for s in active]
        completions = proposer.propose(prompts, derive_seed(seed, "propose", step))
        if len(completions) != len(prompts):
            raise ProposerError(
                f"proposer returned {len(completions)} completions for {len(prompts)} prompts"
            )
        for s, c in zip(active, completions):
            _consume(task, s, str(c), m, budget)
        step += 1
        if ckpt is not None and step % checkpoint_every == 0:
            _save(ckpt, fp, step, states, iterations, budget)
    if ckpt is not None:
        _save(ckpt, fp, step, states, iterations, budget)
    return [s.result(arm, seed, m, budget, iterations) for s in states]


def run_search_batch(
    rows: Sequence[Mapping[str, Any]],
    task: Any,
    proposer: Proposer,
    *,
    iterations: int,
    m: int,
    seed: int,
    budget: int | None = None,
    checkpoint_path: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 10,
    arm: str = "search",
    prompt_mode: str = "auto",
    stop_when_solved: bool = True,
    db_options: Mapping[str, Any] | None = None,
    initial_programs: Callable[[Mapping[str, Any]], Sequence[str]] | None = None,
) -> list[SearchResult]:
    """Evolutionary search on several problems in lockstep (one proposer call per iteration for
    all unfinished problems); see the module doc. ``budget`` (default ``iterations * m``) is the
    per-problem candidate cap; ``db_options`` go to :class:`ProgramDatabase` (its seed is
    derived from ``seed`` and the problem id); ``initial_programs(row)`` seeds every island
    without spending budget."""
    return _run(
        rows,
        task,
        proposer,
        iterations=iterations,
        m=m,
        seed=seed,
        budget=budget,
        checkpoint_path=checkpoint_path,
        checkpoint_every=checkpoint_every,
        arm=arm,
        prompt_mode=prompt_mode,
        stop_when_solved=stop_when_solved,
        db_options=db_options,
        initial_programs=initial_programs,
        use_parents=True,
        kind="search",
    )


def run_search(problem_row: Mapping[str, Any], task: Any, proposer: Proposer, **options: Any) -> SearchResult:
    """Evolutionary search on one problem: :func:`run_search_batch` with a single row (same keywords)."""
    return run_search_batch([problem_row], task, proposer, **options)[0]
