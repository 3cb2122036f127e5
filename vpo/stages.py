"""Pipeline stages: each one a function from a pipeline config to files under its run folder.

``vpo stage NAME --pipeline P`` calls these; ``dvc.yaml`` calls only that CLI, so ``dvc repro``
runs offline without Prefect, and ``flows/`` wraps the same CLI as Prefect tasks. Layout
(``runs/<pipeline>[-quick]/``):

    data/{train,test}.parquet  data/validation.json       stage data
    rewards/reference.parquet  rewards/validation.json    stage rewards
    base/                                                  stage base (tiny model + SFT, or a hub/local model)
    arms/<arm>-s<seed>/{model/,metrics.json,live/}         stage train
    eval/{metrics.json,best_at_k.png,table.md,...}          stage evaluate
    registry.json                                          stage register
    search/...                                             stage search

Every output is written atomically (temp + rename) so a crash leaves the old or the new file.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vpo.config import ArmConfig, PipelineConfig
from vpo.storage import atomic_write_json, atomic_write_text

__all__ = ["STAGES", "run_dir", "load_rows", "arm_runs", "stage_data", "stage_rewards", "stage_base",
           "stage_train", "stage_evaluate", "stage_register", "stage_search", "run_all"]


class StageError(RuntimeError):
    """A stage cannot run (missing upstream output, bad input); the message says what to do."""


def run_dir(cfg: PipelineConfig) -> Path:
    """``<runs_dir>/<pipeline>`` (``-quick`` suffixed for the quick preset)."""
    return cfg.resolve_path(cfg.storage.runs_dir) / (cfg.name + ("-quick" if cfg.quick else ""))


def _task(cfg: PipelineConfig) -> Any:
    from vpo.tasks import get_task

    return get_task(cfg.task.name, **cfg.task.params)


def _log(msg: str) -> None:
    print(f"[vpo] {msg}", flush=True)


def arm_runs(cfg: PipelineConfig) -> list[tuple[ArmConfig, int, str]]:
    """(arm, seed, run id) for every enabled arm and seed, in config order."""
    return [(arm, seed, f"{arm.name}-s{seed}") for arm in cfg.enabled_arms for seed in arm.seeds]


# -- data ----------------------------------------------------------------------------------------
def _rows_frame(rows_by_split: Mapping[str, Sequence[Mapping[str, Any]]]) -> Any:
    import pandas as pd

    records = []
    for split, rows in rows_by_split.items():
        for i, r in enumerate(rows):
            if "id" not in r or "prompt" not in r:
                raise StageError(f"{split} row {i}: a problem row needs 'id' and 'prompt' fields, got {sorted(r)}")
            records.append({"id": str(r["id"]), "split": split, "prompt": r["prompt"],
                            "payload": json.dumps(r, sort_keys=True, default=str)})
    return pd.DataFrame.from_records(records)


def stage_data(cfg: PipelineConfig) -> dict[str, Any]:
    """Build the dataset version from the task (or ``dataset.source``), validate it with great
    expectations, write ``data/<split>.parquet``."""
    from vpo.validation import validate_dataset

    task = _task(cfg)
    rows = {split: task.load(split) for split in cfg.dataset.splits}
    df = _rows_frame(rows)
    if task.reward is not None:
        df["n_dims"] = [int(np.asarray(task.reward.present(json.loads(p))).sum()) for p in df["payload"]]
    summary = validate_dataset(df, name=f"{cfg.name}/data", max_prompt_chars=cfg.dataset.max_prompt_chars,
                               splits=cfg.dataset.splits, min_rows_per_split=cfg.dataset.min_rows_per_split)
    out = run_dir(cfg) / "data"
    out.mkdir(parents=True, exist_ok=True)
    for split in cfg.dataset.splits:
        part = df[df["split"] == split].reset_index(drop=True)
        tmp = out / f".{split}.parquet.tmp"
        part.to_parquet(tmp, index=False)
        os.replace(tmp, out / f"{split}.parquet")
    info = {"rows": {s: len(r) for s, r in rows.items()}, "validation": summary}
    atomic_write_json(out / "validation.json", info)
    _log(f"data: {info['rows']} rows validated -> {out}")
    return info


def load_rows(cfg: PipelineConfig, split: str) -> list[dict[str, Any]]:
    """The rows the data stage wrote for ``split``."""
    import pandas as pd

    path = run_dir(cfg) / "data" / f"{split}.parquet"
    if not path.is_file():
        raise StageError(f"{path} is missing: run `vpo stage data --pipeline {cfg.name}` first")
    return [json.loads(p) for p in pd.read_parquet(path)["payload"]]


# -- rewards -------------------------------------------------------------------------------------
def _reference_answers(task: Any, row: Mapping[str, Any], rng: random.Random) -> list[str]:
    """Reference solutions: the task's own, else parsed from its supervised demonstration."""
    if hasattr(task, "reference_answers"):
        return list(task.reference_answers(row))
    if hasattr(task, "demonstration"):
        return task.reward.parse(task.demonstration(row, 3, rng), 3)
    return []


def stage_rewards(cfg: PipelineConfig) -> dict[str, Any]:
    """Score reference solutions of every problem into reward vectors, validate (dimension count
    per problem, range, NaN only where a dimension is absent) and write ``rewards/reference.parquet``."""
    from vpo.validation import reward_vectors_frame, validate_reward_vectors

    task = _task(cfg)
    rng = random.Random(cfg.seed)
    items, expected = [], {}
    for split in cfg.dataset.splits:
        for row in load_rows(cfg, split):
            answers = _reference_answers(task, row, rng)
            present = np.asarray(task.reward.present(row), dtype=bool)
            expected[str(row["id"])] = int(present.sum())
            values = task.reward.score(answers, row) if answers else np.zeros((0, task.reward.dim))
            items.append((str(row["id"]), np.asarray(values, dtype=np.float64), present))
    df = reward_vectors_frame(items, dim_names=list(task.reward.names))
    summary = validate_reward_vectors(df, name=f"{cfg.name}/rewards", num_dims=task.reward.dim,
                                      expected_present=expected)
    out = run_dir(cfg) / "rewards"
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".reference.parquet.tmp"
    df.to_parquet(tmp, index=False)
    os.replace(tmp, out / "reference.parquet")
    vals = df[df["present"]]["value"].to_numpy(dtype=float) if len(df) else np.zeros(0)
    info = {"problems": len(items), "answers": int(sum(len(v) for _, v, _ in items)),
            "mean_value": float(vals.mean()) if vals.size else None, "validation": summary}
    atomic_write_json(out / "validation.json", info)
    _log(f"rewards: {info['answers']} reference answers over {info['problems']} problems validated")
    return info


# -- base model ----------------------------------------------------------------------------------
def stage_base(cfg: PipelineConfig) -> dict[str, Any]:
    """The starting policy: the embedded tiny model trained by SFT, or a hub id / local path
    (saved locally so every arm and evaluation loads the same files)."""
    out = run_dir(cfg) / "base"
    task = _task(cfg)
    t0 = time.time()
    tmp = out.with_name("base.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if cfg.model.builder == "tiny":
        from vpo.sft import train_sft

        sft = cfg.sft
        train_sft(task, tmp, steps=sft.steps if sft.enabled else 0, batch_size=sft.batch_size, lr=sft.lr,
                  seed=cfg.seed, model_size=dict(cfg.model.builder_params) or None)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src = cfg.model.path_or_id
        assert src is not None
        kw = {"revision": cfg.model.revision, "trust_remote_code": cfg.model.trust_remote_code}
        tok = AutoTokenizer.from_pretrained(src, **kw)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=cfg.model.dtype, **kw)
        _check_tokenizer(tok, src)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if cfg.sft.enabled and hasattr(task, "demonstration"):
            from vpo.sft import train_sft

            train_sft(task, tmp, steps=cfg.sft.steps, batch_size=cfg.sft.batch_size, lr=cfg.sft.lr, seed=cfg.seed,
                      init_dir=tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    info = {"seconds": round(time.time() - t0, 1), "source": cfg.model.builder or cfg.model.path_or_id}
    sft_metrics = out / "sft_metrics.json"
    if sft_metrics.is_file():
        info["sft"] = json.loads(sft_metrics.read_text())
    atomic_write_json(run_dir(cfg) / "base.json", info)
    _log(f"base: ready in {info['seconds']} s -> {out}")
    return info


def _check_tokenizer(tok: Any, src: str) -> None:
    """Generation needs an EOS token (and padding, which falls back to EOS)."""
    if tok.eos_token_id is None:
        raise StageError(f"tokenizer of {src!r} has no eos_token; set one (tokenizer.eos_token = ...) and save it")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token


# -- train ---------------------------------------------------------------------------------------
def stage_train(cfg: PipelineConfig, arm_name: str | None = None, seed: int | None = None) -> dict[str, Any]:
    """Train the named arm (and seed), or every enabled arm and seed; resumes interrupted runs."""
    from vpo.train import train_arm

    base = run_dir(cfg) / "base"
    if not (base / "config.json").is_file():
        raise StageError(f"{base} has no model: run `vpo stage base --pipeline {cfg.name}` first")
    task = _task(cfg)
    rows = load_rows(cfg, "train")
    tr = cfg.trainer
    results = {}
    runs = [r for r in arm_runs(cfg) if (arm_name is None or r[0].name == arm_name) and (seed is None or r[1] == seed)]
    if not runs:
        raise StageError(f"no enabled arm {arm_name!r} with seed {seed} in pipeline {cfg.name!r}; "
                         f"arms: {[a.name for a in cfg.enabled_arms]}")
    for arm, s, rid in runs:
        out = run_dir(cfg) / "arms" / rid
        if (out / "metrics.json").is_file() and (out / "model" / "config.json").is_file():
            _log(f"train: {rid} already trained, skipping (delete {out} to retrain)")
            results[rid] = json.loads((out / "metrics.json").read_text())
            continue
        _log(f"train: {rid} (estimator={arm.estimator}, m={arm.m}, G={arm.num_generations}x{arm.rollout_multiplier})")
        results[rid] = train_arm(
            task, rows, base, out, estimator=arm.estimator, m=arm.m,
            num_generations=arm.num_generations * arm.rollout_multiplier, seed=s, steps=tr.steps,
            prompts_per_step=tr.prompts_per_step, lr=tr.lr, beta=tr.beta, temperature=tr.temperature,
            max_completion_length=tr.max_completion_length, num_weights=tr.num_weights, alpha=tr.alpha,
            sampler=tr.sampler, loss_type=tr.loss_type, gradient_accumulation_steps=tr.gradient_accumulation_steps,
            save_steps=tr.save_steps, logging_steps=tr.logging_steps, use_vllm=tr.generation_backend == "vllm",
        )
    return results


# -- evaluate ------------------------------------------------------------------------------------
def _policies(cfg: PipelineConfig) -> list[tuple[str, str, int, Path]]:
    """(run id, arm name, m, model dir) for the base (in each answer format used) and every arm run."""
    out = []
    for m in sorted({a.m for a in cfg.enabled_arms}):
        out.append((f"base-m{m}", f"base-m{m}", m, run_dir(cfg) / "base"))
    for arm, _, rid in arm_runs(cfg):
        out.append((rid, arm.name, arm.m, run_dir(cfg) / "arms" / rid / "model"))
    return out


def _aggregate(per_run: Mapping[str, Mapping[str, Any]], groups: Mapping[str, list[str]],
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
        f"E_w best@{k}" for k in ks) + " | pass@" + str(ks[-1]) + " | diversity | first answer | collapsed |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for arm, e in agg.items():
        def cell(key: str, k: int) -> str:
            v = e[key].get(str(k))
            return "n/a" if v is None else f"{v['mean']:.3f} ± {v['std']:.3f}"

        lines.append(
            f"| {arm} | {len(e['runs'])} | " + " | ".join(cell("best_at_k", k) for k in ks) + " | "
            + " | ".join(cell("expected_weighted_best_at_k", k) for k in ks) + " | " + cell("pass_at_k", ks[-1])
            + f" | {e['reward_diversity']['mean']:.3f} | {e['first_answer_mean']['mean']:.3f} | "
            f"{e['collapsed_runs']}/{len(e['runs'])} |")
    return "\n".join(lines) + "\n"


def _plot(agg: Mapping[str, Any], ks: Sequence[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, label in zip(axes, ("best_at_k", "expected_weighted_best_at_k", "pass_at_k"),
                              ("best@k (mean scalar w*)", "E_w[best@k], w ~ Dir(1)", "pass@k")):
        for arm, e in agg.items():
            xs = [k for k in ks if str(k) in e[key]]
            ys = np.array([e[key][str(k)]["mean"] for k in xs])
            lo = np.array([e[key][str(k)]["min"] for k in xs])
            hi = np.array([e[key][str(k)]["max"] for k in xs])
            style = "--" if arm.startswith("base") else "-"
            ax.plot(xs, ys, style, marker="o", label=f"{arm} (n={len(e['runs'])})")
            if len(e["runs"]) > 1:
                ax.fill_between(xs, lo, hi, alpha=0.15)
        ax.set_xscale("log")
        ax.set_xticks(list(ks))
        ax.set_xticklabels([str(k) for k in ks])
        ax.set_xlabel("k (candidates)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title + "  (line: mean over seeds, band: min-max)")
    fig.tight_layout()
    tmp = path.with_name("." + path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def stage_evaluate(cfg: PipelineConfig) -> dict[str, Any]:
    """best@k / pass@k / E_w[best@k] / diversity for the base and every arm on the held-out split;
    writes eval/metrics.json (DVC metrics), eval/curves.json (DVC plots), eval/best_at_k.png, eval/table.md."""
    from tqdm.auto import tqdm

    from vpo.evaluate import evaluate_policy

    ev = cfg.evaluation
    task = _task(cfg)
    rows = load_rows(cfg, ev.split)
    if ev.max_problems:
        rows = rows[: ev.max_problems]
    out = run_dir(cfg) / "eval"
    (out / "vectors").mkdir(parents=True, exist_ok=True)
    per_run: dict[str, Any] = {}
    groups: dict[str, list[str]] = {}
    policies = _policies(cfg)
    for rid, arm, m, model_dir in tqdm(policies, desc="evaluate", unit="policy"):
        if not (model_dir / "config.json").is_file():
            raise StageError(f"{model_dir} has no model: run the train stage first")
        t0 = time.time()
        res, vectors = evaluate_policy(task, str(model_dir), rows, m=m, n_samples=ev.n_samples, ks=ev.k,
                                       temperature=ev.temperature,
                                       max_new_tokens=cfg.trainer.max_completion_length, seed=ev.seed,
                                       num_weights=ev.num_weights)
        res["seconds"] = round(time.time() - t0, 1)
        np.save(out / "vectors" / f"{rid}.npy", vectors)
        per_run[rid] = res
        groups.setdefault(arm, []).append(rid)
    agg = _aggregate(per_run, groups, collapse_threshold=0.1)
    ks = [k for k in ev.k if all(str(k) in r["best_at_k"] for r in per_run.values())]
    metrics = {"pipeline": cfg.name, "quick": cfg.quick, "n_problems": len(rows), "n_samples": ev.n_samples,
               "k": list(ev.k), "arms": agg, "runs": per_run}
    atomic_write_json(out / "metrics.json", metrics)
    curves = [{"arm": arm, "k": int(k), "best_at_k": e["best_at_k"][str(k)]["mean"],
               "expected_weighted_best_at_k": e["expected_weighted_best_at_k"][str(k)]["mean"],
               "pass_at_k": e["pass_at_k"][str(k)]["mean"]} for arm, e in agg.items() for k in ks]
    atomic_write_json(out / "curves.json", curves)
    table = _table(agg, ks)
    atomic_write_text(out / "table.md", table)
    _plot(agg, ks, out / "best_at_k.png", f"{cfg.name}: held-out {ev.split}, {len(rows)} problems")
    _log("evaluate: table\n" + table)
    return metrics


# -- register ------------------------------------------------------------------------------------
def _repo_root(start: Path) -> Path:
    for p in [start, *start.parents]:
        if (p / ".git").exists() or (p / "dvc.yaml").exists():
            return p
    return start


def stage_register(cfg: PipelineConfig) -> dict[str, Any]:
    """Register every trained arm checkpoint (content hash, git rev, dvc.lock hash, params,
    evaluation metrics) in the registry; writes registry.json with the entries."""
    from vpo.registry import register

    url = cfg.resolve_url(cfg.storage.registry)
    evals = {}
    eval_path = run_dir(cfg) / "eval" / "metrics.json"
    if eval_path.is_file():
        evals = json.loads(eval_path.read_text())["runs"]
    entries = []
    for arm, seed, rid in arm_runs(cfg):
        model_dir = run_dir(cfg) / "arms" / rid / "model"
        train_metrics = json.loads((run_dir(cfg) / "arms" / rid / "metrics.json").read_text())
        entry = register(url, model_dir, name=cfg.name, arm=rid, params=cfg.params(),
                         metrics={"train": train_metrics, "eval": evals.get(rid, {})},
                         lineage={"estimator": arm.estimator, "m": arm.m, "seed": seed, "base": "base",
                                  "pipeline": cfg.name, "quick": cfg.quick},
                         repo_dir=_repo_root(cfg.base_dir))
        entries.append(_entry_dict(entry))
        _log(f"register: {rid} -> {entries[-1].get('hash', '?')[:12]}")
    info = {"registry": url, "entries": entries}
    atomic_write_json(run_dir(cfg) / "registry.json", info)
    return info


def _entry_dict(entry: Any) -> dict[str, Any]:
    if hasattr(entry, "to_dict"):
        return entry.to_dict()
    if hasattr(entry, "model_dump"):
        return entry.model_dump(mode="json")
    import dataclasses

    return json.loads(json.dumps(dataclasses.asdict(entry), default=str))


# -- search --------------------------------------------------------------------------------------
def stage_search(cfg: PipelineConfig) -> dict[str, Any]:
    """Evolutionary search with each arm's first-seed checkpoint on the hardest held-out problems
    (those no arm solves at best@k_max); curves JSON + PNG under search/."""
    from vpo.search import ModelProposer, hardest_subset, run_arms

    sc = cfg.search
    if sc is None or not sc.enabled:
        _log("search: disabled in the pipeline config")
        return {"enabled": False}
    task = _task(cfg)
    ev = json.loads((run_dir(cfg) / "eval" / "metrics.json").read_text())
    k_max = max(int(k) for k in ev["k"] if all(str(k) in r["best_at_k"] for r in ev["runs"].values()))
    vectors_dir = run_dir(cfg) / "eval" / "vectors"
    rows = load_rows(cfg, cfg.evaluation.split)
    if cfg.evaluation.max_problems:
        rows = rows[: cfg.evaluation.max_problems]
    from vpo.evaluate import scalarise
    from vpo.metrics import pool_best_at_k

    w_star = np.asarray(task.reward.w_star())
    per_arm: dict[str, dict[str, float]] = {}
    for rid in ev["runs"]:
        if rid.startswith("base"):
            continue
        vec = np.load(vectors_dir / f"{rid}.npy")
        scal = scalarise(vec, w_star)
        best = pool_best_at_k(scal, min(k_max, scal.shape[1] * scal.shape[2]))
        per_arm[rid] = {str(r["id"]): float(b) for r, b in zip(rows, np.atleast_1d(best))}
    hard = set(hardest_subset(per_arm, k=k_max)) if per_arm else set()
    selected = [r for r in rows if str(r["id"]) in hard]
    if not selected:  # nothing is unsolved at best@k: search the lowest-scoring problems instead
        mean_best = {pid: np.mean([v[pid] for v in per_arm.values()]) for pid in next(iter(per_arm.values()))}
        worst = sorted(mean_best, key=mean_best.get)[: int(sc.params.get("n_problems", 8))]
        selected = [r for r in rows if str(r["id"]) in set(worst)]
    selected = selected[: int(sc.params.get("n_problems", 8))]
    proposers = {}
    for arm, seed, rid in arm_runs(cfg):
        if seed == arm.seeds[0]:
            proposers[arm.name] = ModelProposer(str(run_dir(cfg) / "arms" / rid / "model"),
                                                max_new_tokens=cfg.trainer.max_completion_length)
    out = run_dir(cfg) / "search"
    result = run_arms(task, selected, proposers, out, iterations=sc.iterations, m=max(a.m for a in cfg.enabled_arms),
                      seed=cfg.seed, **{k: v for k, v in sc.params.items() if k != "n_problems"})
    info = {"problems": [str(r["id"]) for r in selected], "hardest_subset_size": len(hard), "k_max": k_max}
    atomic_write_json(out / "selection.json", info)
    return {**info, "result": result if isinstance(result, dict) else str(result)}


STAGES: dict[str, Callable[..., dict[str, Any]]] = {
    "data": stage_data,
    "rewards": stage_rewards,
    "base": stage_base,
    "train": stage_train,
    "evaluate": stage_evaluate,
    "register": stage_register,
    "search": stage_search,
}


def run_all(cfg: PipelineConfig, *, stages: Sequence[str] = ("data", "rewards", "base", "train", "evaluate",
                                                              "register")) -> dict[str, Any]:
    """Run the stages in order in this process (the main job); returns each stage's summary."""
    results = {}
    for name in stages:
        t0 = time.time()
        results[name] = STAGES[name](cfg)
        _log(f"stage {name} done in {time.time() - t0:.0f} s")
    return results

