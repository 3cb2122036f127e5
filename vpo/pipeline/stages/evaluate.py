"""Stage ``evaluate``: best@k, pass@k, E_w[best@k] and diversity of the base model and every arm run.

Each policy samples a fair pool per held-out problem (an m-answer policy ceil(n/m) rollouts,
:mod:`vpo.evaluate`); metrics are aggregated over seeds per arm (mean, std, min, max), with the
number of runs that collapsed to one strategy (reward diversity under a tenth of the base's) and,
for tasks that can compute it, the prompt-only oracle. Writes ``eval/metrics.json`` (everything),
``curves.json`` (for ``dvc plots``), ``table.md``, ``best_at_k.png``, ``learning_curves.png`` (the arms'
training curves) and the reward vectors of every policy (``vectors/<run>.npy``, read by the search stage).
"""

from __future__ import annotations

import io
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vpo.atomic import atomic_dir, atomic_write_bytes, atomic_write_json, atomic_write_text
from vpo.pipeline.config import PipelineConfig
from vpo.pipeline.config.layout import RunLayout, arm_runs
from vpo.pipeline.engine.checkpoints import check_model_dir
from vpo.pipeline.engine.console import mean_std, progress
from vpo.pipeline.engine.console import table as table_out
from vpo.pipeline.engine.context import StageContext
from vpo.pipeline.engine.inputs import load_rows, stage_command
from vpo.pipeline.engine.policy import sampling_options

__all__ = ["aggregate_runs", "eval_rows", "evaluate_one", "plot_best_at_k", "policies", "results_table", "run"]


@dataclass(frozen=True)
class Policy:
    """One policy to evaluate: the base in one answer format, or an arm run."""

    rid: str
    arm: str
    m: int
    model_dir: Path
    max_new_tokens: int
    goal_conditioned: bool = False


def policies(cfg: PipelineConfig, layout: RunLayout) -> list[Policy]:
    """The base (in each answer format the arms use) and every arm run."""
    from vpo.advantages import get_estimator

    out = []
    for m in sorted({a.num_answers for a in cfg.enabled_arms}):
        limit = max(a.completion_length(cfg.trainer) for a in cfg.enabled_arms if a.num_answers == m)
        out.append(Policy(f"base-m{m}", f"base-m{m}", m, layout.base, limit))
    for r in arm_runs(cfg):
        goal = bool(getattr(get_estimator(r.arm.estimator), "row_weights_column", None))
        out.append(Policy(r.rid, r.arm.name, r.arm.num_answers, layout.arm_model(r.rid),
                          r.arm.completion_length(cfg.trainer), goal))
    return out


def _prompt_fn(task: Any, policy: Policy) -> Any:
    """The prompts a policy is sampled with: :func:`vpo.chat.model_prompt` with its tokenizer (a
    conversation for chat models, the task's text otherwise), and for a goal-conditioned policy, as
    the authors evaluate it, the deployment weighting w* written in."""
    from transformers import AutoTokenizer

    from vpo.advantages import goal_prompt
    from vpo.chat import model_prompt

    tok = AutoTokenizer.from_pretrained(str(policy.model_dir))
    if not policy.goal_conditioned:
        return lambda row, m: model_prompt(task, row, m, tok)
    w_star, names = task.reward.w_star(), list(task.reward.names)
    return lambda row, m: goal_prompt(model_prompt(task, row, m, tok), w_star, names)


def aggregate_runs(per_run: Mapping[str, Mapping[str, Any]], groups: Mapping[str, list[str]],
               collapse_threshold: float) -> dict[str, Any]:
    """Mean, std and min/max over seeds for every metric curve; how many runs collapsed."""
    agg: dict[str, Any] = {}
    for arm, rids in groups.items():
        runs = [per_run[r] for r in rids]
        entry: dict[str, Any] = {"runs": rids}
        for key in ("best_at_k", "pass_at_k", "expected_weighted_best_at_k"):
            ks = runs[0][key].keys()
            entry[key] = {k: {"mean": float(np.mean([r[key][k] for r in runs])),
                              "std": float(np.std([r[key][k] for r in runs])),
                              "min": float(np.min([r[key][k] for r in runs])),
                              "max": float(np.max([r[key][k] for r in runs]))} for k in ks}
        for key in ("reward_diversity", "first_answer_mean", "parse_rate", "distinct_vectors_per_problem"):
            vals = [r[key] for r in runs]
            entry[key] = {"mean": float(np.mean(vals)), "std": float(np.std(vals))}
        entry["collapsed_runs"] = int(sum(r["reward_diversity"] < collapse_threshold for r in runs))
        agg[arm] = entry
    return agg


def _table(agg: Mapping[str, Any], ks: Sequence[int]) -> str:
    head = "| arm | runs | " + " | ".join(f"best@{k}" for k in ks) + " | " + " | ".join(
        f"E_w best@{k}" for k in ks) + " | pass@" + str(ks[-1]) + " | diversity | first answer | parsed | collapsed |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for arm, e in agg.items():
        def cell(key: str, k: int, e: Mapping[str, Any] = e) -> str:
            v = e[key].get(str(k))
            return "n/a" if v is None else mean_std(v, len(e["runs"]))

        lines.append(
            f"| {arm} | {len(e['runs'])} | " + " | ".join(cell("best_at_k", k) for k in ks) + " | "
            + " | ".join(cell("expected_weighted_best_at_k", k) for k in ks) + " | " + cell("pass_at_k", ks[-1])
            + f" | {mean_std(e['reward_diversity'], len(e['runs']))}"
            f" | {e['first_answer_mean']['mean']:.3f} | {e['parse_rate']['mean']:.0%} | "
            f"{e['collapsed_runs']}/{len(e['runs'])} |")
    return "\n".join(lines) + "\n"


def results_table(agg: Mapping[str, Any], ks: Sequence[int], pool: str,
                  oracle: Mapping[str, Any] | None = None) -> str:
    """The markdown result table (mean ± std over seeds per arm), with the line saying how best@k
    draws its candidates and, where the task has one, the oracle line."""
    return _pool_line(pool) + _table(agg, ks) + _oracle_line(oracle, ks)


def _oracle(task: Any, rows: Sequence[Mapping[str, Any]], ks: Sequence[int]) -> dict[str, Any] | None:
    """Reference ceilings on the mean scalar for tasks that can compute them (route): the
    prompt-only greedy best-of-k (what k answers chosen without the hidden information can reach)
    and the full-information best. None for tasks without oracles."""
    curve_fn = getattr(task, "hedge_curve", None)
    if curve_fn is None or not rows or not ks:
        return None
    curves = np.array([curve_fn(r, max(ks)) for r in rows])
    return {"prompt_only_best_at_k": {str(k): float(curves[:, k - 1].mean()) for k in ks},
            "full_information": float(np.mean([task.best_scalar(r) for r in rows])),
            "full_information_label": task.full_information_oracle}


def _pool_line(pool: str) -> str:
    """Which best@k protocol a table uses (every table says it)."""
    if pool == "slots":
        return ("best@k over k answer slots drawn from the flattened pool of all rollouts' answers (the "
                "authors' evaluation code), exact expectation.\n\n")
    return ("best@k over whole rollouts: an m-answer policy gets ceil(k/m) rollouts, the last one its first "
            "k mod m answers (the paper's protocol), exact expectation.\n\n")


def _oracle_line(oracle: Mapping[str, Any] | None, ks: Sequence[int]) -> str:
    if not oracle:
        return ""
    pts = ", ".join(f"best@{k} {oracle['prompt_only_best_at_k'][str(k)]:.3f}" for k in ks)
    return (f"\nOracle (mean scalar; answers chosen from the prompt alone, greedy): {pts}; "
            f"{oracle['full_information_label']}: {oracle['full_information']:.3f}.\n")


def plot_best_at_k(agg: Mapping[str, Any], ks: Sequence[int], path: Path, title: str,
          oracle: Mapping[str, Any] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vpo.plots import coinciding_note, k_axis, y_range

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, label in zip(axes, ("best_at_k", "expected_weighted_best_at_k", "pass_at_k"),
                              ("best@k (mean scalar w*)", "E_w[best@k], w ~ Dir(1)", "pass@k")):
        drawn: dict[str, list[float]] = {}
        for arm, e in agg.items():
            xs = [k for k in ks if str(k) in e[key]]
            ys = np.array([e[key][str(k)]["mean"] for k in xs])
            lo = np.array([e[key][str(k)]["min"] for k in xs])
            hi = np.array([e[key][str(k)]["max"] for k in xs])
            style = "--" if arm.startswith("base") else "-"
            drawn[arm] = list(ys)
            (line,) = ax.plot(xs, ys, style, marker="o", label=f"{arm} (n={len(e['runs'])})")
            if len(e["runs"]) > 1:
                ax.fill_between(xs, lo, hi, alpha=0.15, color=line.get_color())
        if oracle and key == "best_at_k":
            ax.plot(list(ks), [oracle["prompt_only_best_at_k"][str(k)] for k in ks], ":", color="0.4",
                    label="oracle, prompt only")
        k_axis(ax, ks)
        shown = [v for ys in drawn.values() for v in ys]
        if oracle and key == "best_at_k":
            shown += [oracle["prompt_only_best_at_k"][str(k)] for k in ks]
        ax.set_ylim(*y_range(shown))
        note = coinciding_note(drawn)
        if note:  # a line under an identical one would be invisible: say so
            ax.text(0.01, 0.01, note, transform=ax.transAxes, fontsize=7, color="0.3", va="bottom", wrap=True)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title + "  (line: mean over seeds, band: min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)  # inside the stage's temp folder: published with it
    plt.close(fig)


def _learning_plot(cfg: PipelineConfig, layout: RunLayout, path: Path) -> None:
    """Training curves of every arm (mean and min-max over its seeds) from the runs' history.json."""
    import json

    from vpo.plots import learning_curves

    histories: dict[str, list[list[dict[str, Any]]]] = {}
    for r in arm_runs(cfg):
        hist = layout.arm_history(r.rid)
        if hist.is_file():
            histories.setdefault(r.arm.name, []).append(json.loads(hist.read_text()))
    if histories:
        learning_curves(histories, path, f"{cfg.variant}: training",
                        smooth=max(1, min(10, cfg.trainer.max_steps // 20)))


def _summary(agg: Mapping[str, Any], ks: Sequence[int]) -> dict[str, Any]:
    """The headline numbers of each trained arm (mean over seeds) for ``dvc metrics show`` and ``dvc exp
    show``, grouped by metric so the columns read ``best@5.grpo  best@5.vpo ... div.grpo ...``: best@k
    at the largest k first, then ``div``, the reward diversity. Two short-named numbers per arm keep an
    experiment's row, its changed setting included, within 200 columns; the rest is in ``metrics.json``."""
    k = ks[-1]
    arms = {arm: e for arm, e in agg.items() if not arm.startswith("base")}
    return {f"best@{k}": {arm: round(e["best_at_k"][str(k)]["mean"], 4) for arm, e in arms.items()},
            "div": {arm: round(e["reward_diversity"]["mean"], 4) for arm, e in arms.items()}}


def _save_npy(path: Path, array: np.ndarray) -> None:
    """``np.save`` through temp + rename (np.save itself writes in place)."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    atomic_write_bytes(path, buf.getvalue())


def eval_rows(cfg: PipelineConfig, layout: RunLayout) -> list[dict[str, Any]]:
    """The held-out problems the evaluation (and the search) use: ``evaluation.split``, at most
    ``evaluation.max_problems`` of them, in the split's order."""
    rows = load_rows(cfg, cfg.evaluation.split, layout)
    return rows[: cfg.evaluation.max_problems] if cfg.evaluation.max_problems else rows


def evaluate_one(cfg: PipelineConfig, task: Any, rows: Sequence[Mapping[str, Any]], policy: Policy
                 ) -> tuple[dict[str, Any], np.ndarray]:
    """One policy's metrics (with the seconds it took) and reward vectors, sampled with the
    pipeline's evaluation settings: what the stage computes for each policy."""
    from vpo.evaluate import evaluate_policy
    from vpo.generation import release_policy

    ev = cfg.evaluation
    t0 = time.time()
    options = sampling_options(cfg)  # on this stage's device in the policy's dtype; one vLLM engine at a time
    res, vectors = evaluate_policy(task, str(policy.model_dir), rows, m=policy.m, n_samples=ev.n_samples, ks=ev.k,
                                   temperature=ev.temperature, max_new_tokens=policy.max_new_tokens, seed=ev.seed,
                                   num_weights=ev.num_weights, pool=ev.pool, prompt_fn=_prompt_fn(task, policy),
                                   **options)
    release_policy()  # this policy's memory (model or vLLM engine) is free before the next one loads
    res["seconds"] = round(time.time() - t0, 1)
    return res, vectors


def run(ctx: StageContext) -> dict[str, Any]:
    """Sample, score and aggregate every policy; write ``eval/``."""
    cfg, layout, task = ctx.cfg, ctx.layout, ctx.task
    ev = cfg.evaluation
    rows = eval_rows(cfg, layout)
    per_run: dict[str, Any] = {}
    groups: dict[str, list[str]] = {}
    todo = policies(cfg, layout)
    for p in todo:  # every input checked before hours of sampling start
        fix = (f"rebuild it with `{stage_command(cfg, 'base')}`" if p.rid.startswith("base")
               else f"retrain it with `{stage_command(cfg, 'train', p.rid)}`")
        check_model_dir(p.model_dir, f"policy {p.rid}", fix)
    with atomic_dir(layout.eval) as tmp:  # the old eval/ stays whole until every file of the new one is written
        (tmp / "vectors").mkdir()
        bar = progress("evaluate", len(todo), unit="policies") if ctx.progress else None
        for p in todo:
            if bar is not None:
                bar.numbers(note=p.rid)
            res, vectors = evaluate_one(cfg, task, rows, p)
            _save_npy(tmp / "vectors" / layout.eval_vectors(p.rid).name, vectors)
            per_run[p.rid] = res
            groups.setdefault(p.arm, []).append(p.rid)
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.numbers(note="")
            bar.close()
        # a run "collapsed to one strategy" when its reward-space diversity fell below a tenth of the
        # base model's (absolute 0.1 without a base evaluation)
        base_div = [r["reward_diversity"] for rid, r in per_run.items() if rid.startswith("base")]
        collapse = 0.1 * float(max(base_div)) if base_div else 0.1
        agg = aggregate_runs(per_run, groups, collapse_threshold=collapse)
        ks = [k for k in ev.k if all(str(k) in r["best_at_k"] for r in per_run.values())]
        oracle = _oracle(task, rows, ks)
        metrics = {"pipeline": cfg.name, "variant": cfg.variant, "quick": cfg.quick, "n_problems": len(rows),
                   "n_samples": ev.n_samples, "k": list(ev.k), "pool": ev.pool, "collapse_threshold": collapse,
                   "arms": agg, "runs": per_run, "oracle": oracle}
        atomic_write_json(tmp / layout.eval_metrics.name, metrics)
        curves = [{"arm": arm, "k": int(k), "best_at_k": e["best_at_k"][str(k)]["mean"],
                   "expected_weighted_best_at_k": e["expected_weighted_best_at_k"][str(k)]["mean"],
                   "pass_at_k": e["pass_at_k"][str(k)]["mean"]} for arm, e in agg.items() for k in ks]
        atomic_write_json(tmp / layout.eval_curves.name, curves)
        atomic_write_json(tmp / layout.eval_summary.name, _summary(agg, ks))
        table = results_table(agg, ks, ev.pool, oracle)
        atomic_write_text(tmp / layout.eval_table.name, table)
        plot_best_at_k(agg, ks, tmp / layout.eval_plot.name, f"{cfg.variant}: held-out {ev.split}, {len(rows)} problems",
              oracle)
        _learning_plot(cfg, layout, tmp / layout.eval_learning_plot.name)
    table_out(table)
    ctx.outcome(f"{len(todo)} policies on {len(rows)} problems -> {layout.eval_table.name}, {layout.eval_plot.name}")
    return {"n_problems": len(rows), "arms": {a: {"runs": e["runs"]} for a, e in agg.items()}}
