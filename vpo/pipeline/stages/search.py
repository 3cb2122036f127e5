"""Stage ``search``: evolutionary search with each arm's first-seed checkpoint on held-out problems.

The problems no arm solves at best@k_max in the evaluation (the hardest subset) come first, then the
next hardest by mean best@k_max, up to ``search.n_problems``. Every arm gets the same budget of
answer slots per problem (an m-answer policy spends m per call) and, with ``search.baseline``, a
best-of-k run with the same budget. The arms are independent: as many as ``execution.max_parallel``
allows search at once, each a ``vpo stage search --arm A`` process with a run's threads and GPUs
(one at a time they search in this process, with the same threads, so the results are the same).
Resumable: ``search/checkpoints/`` holds the interrupted search of this very request (other settings
or checkpoints start fresh), finished arms are read back from it, and it is deleted once the stage finished.
With ``search.method: openevolve`` each checkpoint is served by vLLM and searched by OpenEvolve.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vpo.atomic import atomic_write_json, atomic_write_text
from vpo.pipeline.config import PipelineConfig
from vpo.pipeline.config.layout import ArmRun, RunLayout, arm_runs
from vpo.pipeline.engine.console import log, progress
from vpo.pipeline.engine.console import table as table_out
from vpo.pipeline.engine.context import StageContext
from vpo.pipeline.engine.errors import StageError
from vpo.pipeline.engine.execution import concurrency, stage_threads, torch_threads
from vpo.pipeline.engine.inputs import read_json, read_npy, stage_command
from vpo.pipeline.engine.policy import sampling_options
from vpo.pipeline.engine.state import read_state, why_stale, write_state

__all__ = ["arm_proposer", "run", "search_budget", "search_options", "search_shard", "search_table", "select_problems"]


def _fresh_checkpoints(ctx: StageContext, ck_dir: Path) -> None:
    """Resume only a search of this very request; anything else starts fresh (saying why)."""
    fp = ctx.fingerprint
    request = ck_dir / "request.json"
    if ck_dir.is_dir() and fp is not None:
        reason = why_stale(read_state(request), fp, ck_dir, output_exists=True)
        if reason is not None:
            log(f"search: checkpoints in {ck_dir} belong to another request ({reason}); starting fresh")
            shutil.rmtree(ck_dir)
    ck_dir.mkdir(parents=True, exist_ok=True)
    if fp is not None:
        write_state(request, fp, "", {})


def select_problems(task: Any, rows: Sequence[Mapping[str, Any]], vectors: Mapping[str, np.ndarray], k_max: int,
                    pool: str, n_problems: int) -> tuple[list[Mapping[str, Any]], list[str]]:
    """The problems to search and the hardest subset, ranked by the evaluation ``vectors`` of some policies
    (``{policy: (problems, chains, m, d)}``, rows in ``rows``' order): first the problems none of them
    solves at best@k_max, hardest first, then the next hardest by their mean best@k_max, up to
    ``n_problems``. "Solved" = the problem's best achievable scalar (route: 0.75; else 1)."""
    from vpo.evaluate import scalarise
    from vpo.metrics import pool_best_at_k
    from vpo.search import hardest_subset

    w_star = np.asarray(task.reward.w_star())
    oracle = getattr(task, "best_scalar", None)
    target = {str(r["id"]): float(oracle(r)) if callable(oracle) else 1.0 for r in rows}
    per_policy: dict[str, dict[str, float]] = {}
    for name, vec in vectors.items():
        scal = scalarise(vec, w_star)
        best = pool_best_at_k(scal, min(k_max, scal.shape[1] * scal.shape[2]), pool=pool)
        per_policy[name] = {str(r["id"]): float(b) / target[str(r["id"])] for r, b in zip(rows, np.atleast_1d(best))}
    hard = hardest_subset(per_policy, k=k_max, threshold=1.0 - 1e-6) if per_policy else []
    mean_best = {pid: float(np.mean([v[pid] for v in per_policy.values()])) if per_policy else 0.0 for pid in target}
    rest = sorted((pid for pid in target if pid not in set(hard)), key=lambda p: (mean_best[p], p))
    by_id = {str(r["id"]): r for r in rows}
    return [by_id[pid] for pid in (hard + rest)[:n_problems]], hard


def _selection(ctx: StageContext) -> tuple[list[Mapping[str, Any]], list[str], int]:
    """The problems to search, ranked by every arm run's evaluation, the hardest subset, and k_max."""
    from vpo.pipeline.stages.evaluate import eval_rows

    cfg, layout, sc = ctx.cfg, ctx.layout, ctx.cfg.search
    assert sc is not None
    fix = f"rebuild it with `{stage_command(cfg, 'evaluate')}`"
    ev = read_json(layout.eval_metrics, fix)
    k_max = max(int(k) for k in ev["k"] if all(str(k) in r["best_at_k"] for r in ev["runs"].values()))
    vectors = {rid: read_npy(layout.eval_vectors(rid), fix) for rid in ev["runs"] if not rid.startswith("base")}
    selected, hard = select_problems(ctx.task, eval_rows(cfg, layout), vectors, k_max, ev.get("pool", "rollouts"),
                                     sc.n_problems)
    return selected, hard, k_max


def arm_proposer(cfg: PipelineConfig, task: Any, run: ArmRun, model_dir: Path) -> Any:
    """A run's checkpoint as a search proposer (loaded on first use), sampling as its arm trained."""
    from vpo.search import ModelProposer

    opts = sampling_options(cfg)  # on this stage's device in the policy's dtype; one vLLM engine at a time
    return ModelProposer(str(model_dir), max_new_tokens=run.arm.completion_length(cfg.trainer),
                         system_message=getattr(task, "system_prompt", None), backend=opts["backend"],
                         load_kwargs=opts["load"], sample_kwargs={"engine": opts["engine"]})


def _proposers(ctx: StageContext) -> dict[str, Any]:
    """Each arm's first-seed checkpoint as a proposer (loaded on first use)."""
    return {r.arm.name: arm_proposer(ctx.cfg, ctx.task, r, ctx.layout.arm_model(r.rid))
            for r in arm_runs(ctx.cfg) if r.seed == r.arm.seeds[0]}


def search_options(cfg: PipelineConfig) -> dict[str, Any]:
    """The settings every arm's search shares (:func:`vpo.search.run_arms` / ``search_arm``)."""
    sc = cfg.search
    assert sc is not None
    return {"seed": cfg.seed, "baseline": sc.baseline, "prompt_mode": sc.prompt_mode,
            "checkpoint_every": sc.checkpoint_every, "stop_when_solved": sc.stop_when_solved,
            "db_options": sc.database.model_dump()}


def search_budget(cfg: PipelineConfig) -> tuple[dict[str, int], int]:
    """Answers per call of each arm, and the candidate budget every arm gets."""
    sc = cfg.search
    assert sc is not None
    m_of = {arm.name: arm.num_answers for arm in cfg.enabled_arms}
    return m_of, (sc.iterations * max(m_of.values()) if sc.budget is None else int(sc.budget))


def search_shard(ctx: StageContext, arm: str) -> dict[str, Any]:
    """One arm's search (and its best-of-k) into ``search/checkpoints/``: what a ``vpo stage search
    --arm A`` process does beside the others; ``vpo stage search`` then puts the finished arms together."""
    from vpo.search import search_arm

    proposers = _proposers(ctx)
    if arm not in proposers:
        raise StageError(f"search: no enabled arm {arm!r} in pipeline {ctx.cfg.name!r}; arms: {', '.join(proposers)}")
    selected, _, _ = _selection(ctx)
    m_of, budget = search_budget(ctx.cfg)
    try:
        with torch_threads(stage_threads(ctx.cfg)):
            out = search_arm(selected, ctx.task, arm, proposers[arm], ctx.layout.search_checkpoints, m=m_of[arm],
                             budget=budget, **search_options(ctx.cfg))
    except ValueError as exc:  # a checkpoint of another request: only the whole stage may start afresh
        if "checkpoint" not in str(exc):
            raise
        raise StageError(f"search@{arm}: {exc}; `{stage_command(ctx.cfg, 'search')}` starts the search afresh "
                         "when the request changed") from None
    solved = {name: sum(bool(r.solved) for r in rs) for name, rs in out.items()}
    ctx.outcome(", ".join(f"{name} solved {n}/{len(selected)}" for name, n in solved.items()))
    return {"solved": solved}


def _shards_side_by_side(ctx: StageContext, arms: Sequence[str], bar: Any) -> bool:
    """Search the arms as ``vpo stage search --arm A`` processes, as many at once as
    ``execution.max_parallel`` and the machine allow (each with a run's threads and GPUs); whether it
    did (one at a time, the caller searches them in this process, with the same threads)."""
    from vpo.pipeline.engine.fanout import run_processes

    ex = concurrency(ctx.cfg, len(arms))
    if len(arms) < 2 or ex.max_parallel < 2:
        return False
    log(f"search: {len(arms)} arms, {ex.max_parallel} at once ({ex.reason})")
    per_arm = 2 if ctx.cfg.search is not None and ctx.cfg.search.baseline else 1

    def done(label: str) -> None:
        if bar is not None:
            bar.update(per_arm)

    run_processes([(f"search@{arm}", ["stage", "search", *ctx.cfg.cli_args(), "--arm", arm]) for arm in arms], ex,
                  layout=ctx.layout, on_done=done)
    return True


def run(ctx: StageContext) -> dict[str, Any]:
    """Select the problems, search them with every arm (and best-of-k), write ``search/``."""
    from vpo.search import run_arms

    cfg, layout, task = ctx.cfg, ctx.layout, ctx.task
    sc = cfg.search
    if sc is None or not sc.enabled:
        log("search: disabled in the pipeline config")
        return {"enabled": False}
    if sc.method == "openevolve" and importlib.util.find_spec("openevolve") is None:
        raise StageError(f"pipeline {cfg.name!r}: search.method is openevolve but the openevolve package is not "
                         "installed (pip install 'vpo[openevolve]')")
    selected, hard, k_max = _selection(ctx)
    out = layout.search
    ctx.invalidate_record()  # search/ is rewritten file by file from here on
    if sc.method == "openevolve":
        return _search_openevolve(cfg, layout, task, selected, out)
    proposers = _proposers(ctx)
    m_of, budget = search_budget(cfg)
    _fresh_checkpoints(ctx, layout.search_checkpoints)
    bar = progress("search", len(proposers) * (2 if sc.baseline else 1), unit="runs") if ctx.progress else None
    searched_beside = _shards_side_by_side(ctx, list(proposers), bar)

    def arm_done(arm: str, results: Sequence[Any]) -> None:
        if bar is not None and not searched_beside:
            bar.numbers(note=f"{arm}: solved {sum(bool(r.solved) for r in results)}/{len(results)}")
            bar.update()

    # the arms the processes above searched are read back from their finished checkpoints
    with torch_threads(stage_threads(cfg)):
        result = run_arms(task, selected, proposers, out, m=m_of, budget=budget, on_arm_done=arm_done,
                          title=f"{cfg.variant}: search on {len(selected)} held-out problems ({len(hard)} hardest first)",
                          **search_options(cfg))
    if bar is not None:
        bar.numbers(note="")
        bar.close()
    info = {"problems": [str(r["id"]) for r in selected], "hardest_subset": hard, "k_max": k_max}
    atomic_write_json(out / "selection.json", info)
    vpo_arms = [a.name for a in cfg.enabled_arms if a.estimator == "vpo" and a.name in proposers]
    table = search_table(result["curves"], result["comparison"], hard, k_max,
                         reference=(vpo_arms or list(proposers))[0], blind=_parents_unseen(sc.prompt_mode, task))
    atomic_write_text(layout.search_table, table)
    table_out(table)
    ctx.outcome(f"{len(selected)} problems x {len(proposers)} arms -> {layout.search_table.name}, "
                f"{layout.search_plot.name}")
    return {**info, "solved": {arm: c["final_solved"] for arm, c in result["curves"].items()}}


def _parents_unseen(mode: str, task: Any) -> str | None:
    """Why the proposals do not see their parents (None: they do): then the evolutionary search draws
    independent samples, exactly what best-of-k draws with the same seeds."""
    if mode == "plain":
        return "search.prompt_mode is plain"
    if mode == "auto" and not callable(getattr(task, "search_prompt", None)):
        return (f"search.prompt_mode is auto and the {getattr(task, 'name', 'task')!s} task has no search prompt "
                "(its policy was never trained to read parents)")
    return None


def search_table(curves: Mapping[str, Any], comparison: Mapping[str, Any], hard: Sequence[str], k_max: int,
                 reference: str | None = None, blind: str | None = None) -> str:
    """Markdown: problems solved and mean best score per search arm at the full budget (overall and
    on the hardest subset), then the problems one arm solves and the other does not, for the pairs
    that answer a question: ``reference`` (the VPO arm) against each other arm, and each arm's search
    against its own best-of-k. The table grows with the number of arms, not with its square; every
    pair stays in ``comparison.json``. ``blind`` says why the proposals do not see their parents: an
    arm whose search found exactly what its best-of-k found is then one row, and the caption says why."""
    from vpo.search.runner import BASELINE_SUFFIX

    n = next(iter(curves.values()))["n_problems"]
    hard_set = set(hard)
    caption = (f"Search on {n} held-out problems, hardest first; the hardest subset is the {len(hard)} problems "
               f"no arm solves at best@{k_max}. Equal budget of answer slots per problem and arm (an m-answer "
               f"policy spends m per call); candidates used = distinct parseable answers scored; solved = the "
               f"problem's best achievable score reached.")
    same = {arm for arm in curves if blind and (base := curves.get(arm + BASELINE_SUFFIX)) is not None
            and _outcome(curves[arm]) == _outcome(base)}
    if same:
        caption += (f" Search and best-of-k are one row for {', '.join(sorted(same))}: {blind}, so each proposal is an "
                    "independent sample and the evolutionary search draws exactly what best-of-k draws "
                    "(`search.prompt_mode: parents` shows the parents to a policy that can read them).")
    lines = [caption, "",
             f"| arm | solved | solved of the hardest {len(hard)} | mean best score | candidates used |",
             "|---|---|---|---|---|"]
    for arm, c in curves.items():
        if arm.endswith(BASELINE_SUFFIX) and arm[: -len(BASELINE_SUFFIX)] in same:
            continue
        on_hard = len(hard_set & set(c["solved_ids"]))
        name = f"{arm} (= best-of-k)" if arm in same else arm
        lines.append(f"| {name} | {c['final_solved']}/{c['n_problems']} | {on_hard} | {c['final_mean_best']:.3f} | "
                     f"{c['candidates_used']} |")
    lines += ["", "| pair (a vs b) | solved by a only | by b only | both | neither |", "|---|---|---|---|---|"]
    for pair, d in comparison.items():
        a, b = pair.split(" vs ", 1)
        if reference is not None and reference not in (a, b) and b != a + BASELINE_SUFFIX:
            continue
        if a in same and b == a + BASELINE_SUFFIX:
            continue
        only_a, only_b = d["n_a_only"], d["n_b_only"]
        if b == reference:  # the reference arm on the left in every row
            a, b, only_a, only_b = b, a, only_b, only_a
        lines.append(f"| {a} vs {b} | {only_a} | {only_b} | {d['n_both']} | {d['n_neither']} |")
    return "\n".join(lines) + "\n"


def _outcome(curve: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a search found: the problems it solved, its mean best score and the candidates it spent."""
    return (sorted(map(str, curve["solved_ids"])), round(float(curve["final_mean_best"]), 9), curve["candidates_used"])


def _search_openevolve(cfg: PipelineConfig, layout: RunLayout, task: Any, rows: list[dict[str, Any]], out: Path
                       ) -> dict[str, Any]:
    """OpenEvolve on each selected problem with each arm's first-seed checkpoint: the checkpoint is
    served by vLLM's OpenAI-compatible server (``search.server_url`` host/port), one arm at a time."""
    from urllib.parse import urlparse

    from vpo.search.openevolve_bridge import VLLMServer, run_openevolve

    sc = cfg.search
    assert sc is not None
    url = urlparse(sc.server_url or "http://127.0.0.1:8000/v1")
    summary: dict[str, dict[str, Any]] = {}
    for r in arm_runs(cfg):
        if r.seed != r.arm.seeds[0]:
            continue
        arm = r.arm
        arm_out = out / "openevolve" / arm.name
        arm_out.mkdir(parents=True, exist_ok=True)
        with VLLMServer(layout.arm_model(r.rid), host=url.hostname or "127.0.0.1",
                        port=url.port or 8000, seed=cfg.seed, log_path=arm_out / "vllm.log") as srv:
            per = {str(r["id"]): run_openevolve(r, task, api_base=srv.base_url, model=srv.model,
                                                out_dir=arm_out / str(r["id"]), iterations=sc.iterations,
                                                seed=cfg.seed, task_name=cfg.task.name,
                                                task_params=cfg.task.params)
                   for r in rows}
        summary[arm.name] = {pid: {"solved": bool(v["solved"]), "best_score": float(v["best_score"])}
                             for pid, v in per.items()}
        log(f"search[openevolve] {arm.name}: solved {sum(v['solved'] for v in summary[arm.name].values())}"
             f"/{len(rows)}")
    atomic_write_json(out / "openevolve.json", summary)
    return {"method": "openevolve", "arms": summary}
