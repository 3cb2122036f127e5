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

Every output is written atomically so a crash leaves the old or the new version, never a torn one:
``data/``, ``rewards/``, ``base/``, ``eval/`` and each arm's ``model/`` are built in a temp sibling
folder and swapped in whole (:func:`vpo.storage.atomic_dir`), single files go through temp + rename.
``run_all`` holds the run folder's lock (:mod:`vpo.locking`) so two runs never write it at once.
"""

from __future__ import annotations

import io
import json
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vpo.config import ArmConfig, PipelineConfig
from vpo.storage import atomic_dir, atomic_write_bytes, atomic_write_json, atomic_write_text

__all__ = [
    "STAGES",
    "arm_runs",
    "load_rows",
    "run_all",
    "run_dir",
    "stage_base",
    "stage_data",
    "stage_evaluate",
    "stage_register",
    "stage_rewards",
    "stage_search",
    "stage_train",
]


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


def published_mode(folder: Path) -> None:
    """Give a folder built by :func:`atomic_dir` (``mkdtemp``: mode 0700) the umask's usual mode, so
    the published folder is as readable as one made by ``mkdir``."""
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)


def arm_runs(cfg: PipelineConfig) -> list[tuple[ArmConfig, int, str]]:
    """(arm, seed, run id) for every enabled arm and seed, in config order."""
    return [(arm, seed, f"{arm.name}-s{seed}") for arm in cfg.enabled_arms for seed in arm.seeds]


# -- data ----------------------------------------------------------------------------------------
def _rows_frame(rows_by_split: Mapping[str, Sequence[Mapping[str, Any]]]) -> Any:
    import pandas as pd

    records = []
    for split, rows in rows_by_split.items():
        for i, r in enumerate(rows):
            _check_row(r, split, i)
            records.append({"id": str(r["id"]), "split": split, "prompt": r["prompt"],
                            "payload": json.dumps(r, sort_keys=True, default=str)})
    return pd.DataFrame.from_records(records)


def _check_row(row: Any, split: str, index: int) -> None:
    """A problem row is a mapping with a str/int ``id`` and a non-empty string ``prompt``."""
    where = f"dataset split {split!r}, row {index}"
    if not isinstance(row, Mapping):
        raise StageError(f"{where}: expected a mapping with 'id' and 'prompt' fields, got {type(row).__name__}")
    missing = [k for k in ("id", "prompt") if k not in row]
    if missing:
        raise StageError(f"{where}: missing field(s) {missing}; a problem row needs 'id' and 'prompt', "
                         f"got fields {sorted(map(str, row))}")
    where += f" (id {row['id']!r})"
    if isinstance(row["id"], bool) or not isinstance(row["id"], (str, int)) or str(row["id"]) == "":
        raise StageError(f"{where}: field 'id' must be a non-empty string or an integer, "
                         f"got {type(row['id']).__name__}")
    if not isinstance(row["prompt"], str) or not row["prompt"].strip():
        raise StageError(f"{where}: field 'prompt' must be a non-empty string, got "
                         f"{type(row['prompt']).__name__} {str(row['prompt'])[:40]!r}")


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
    info = {"rows": {s: len(r) for s, r in rows.items()}, "validation": summary}
    with atomic_dir(out) as tmp:
        published_mode(tmp)
        for split in cfg.dataset.splits:
            df[df["split"] == split].reset_index(drop=True).to_parquet(tmp / f"{split}.parquet", index=False)
        atomic_write_json(tmp / "validation.json", info)
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
    from vpo.rewards import validate_reward_matrix
    from vpo.validation import reward_vectors_frame, validate_reward_vectors

    task = _task(cfg)
    rng = random.Random(cfg.seed)
    items, expected = [], {}
    for split in cfg.dataset.splits:
        for row in load_rows(cfg, split):
            answers = _reference_answers(task, row, rng)
            present = np.asarray(task.reward.present(row), dtype=bool)
            expected[str(row["id"])] = int(present.sum())
            if answers:
                values = validate_reward_matrix(task.reward.score(answers, row), len(answers), present,
                                                f"reference answers of {split} row id {row['id']!r}")
            else:
                values = np.zeros((0, task.reward.dim))
            items.append((str(row["id"]), np.asarray(values, dtype=np.float64), present))
    df = reward_vectors_frame(items, dim_names=list(task.reward.names))
    summary = validate_reward_vectors(df, name=f"{cfg.name}/rewards", num_dims=task.reward.dim,
                                      expected_present=expected)
    out = run_dir(cfg) / "rewards"
    vals = df[df["present"]]["value"].to_numpy(dtype=float) if len(df) else np.zeros(0)
    info = {"problems": len(items), "answers": int(sum(len(v) for _, v, _ in items)),
            "mean_value": float(vals.mean()) if vals.size else None, "validation": summary}
    with atomic_dir(out) as tmp:
        published_mode(tmp)
        df.to_parquet(tmp / "reference.parquet", index=False)
        atomic_write_json(tmp / "validation.json", info)
    _log(f"rewards: {info['answers']} reference answers over {info['problems']} problems validated")
    return info


# -- base model ----------------------------------------------------------------------------------
def stage_base(cfg: PipelineConfig) -> dict[str, Any]:
    """The starting policy: the embedded tiny model trained by SFT, or a hub id / local path
    (saved locally so every arm and evaluation loads the same files)."""
    out = run_dir(cfg) / "base"
    task = _task(cfg)
    t0 = time.time()
    with atomic_dir(out) as tmp:  # the old base/ stays whole until the new one is complete
        published_mode(tmp)
        if cfg.model.builder == "tiny":
            from vpo.sft import train_sft
            from vpo.tiny import build_char_tokenizer

            _check_tokenizer(build_char_tokenizer(task.charset), f"the tiny builder (task {cfg.task.name!r})")
            sft = cfg.sft
            train_sft(task, tmp, steps=sft.steps if sft.enabled else 0, batch_size=sft.batch_size, lr=sft.lr,
                      seed=cfg.seed, model_size=dict(cfg.model.builder_params) or None)
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            src = cfg.model.path_or_id
            assert src is not None
            kw = {"revision": cfg.model.revision, "trust_remote_code": cfg.model.trust_remote_code}
            tok = AutoTokenizer.from_pretrained(src, **kw)
            _check_tokenizer(tok, f"model {src!r}")  # before the (possibly large) model is loaded
            model = AutoModelForCausalLM.from_pretrained(src, dtype=cfg.model.dtype, **kw)
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            if cfg.sft.enabled and hasattr(task, "demonstration"):
                from vpo.sft import train_sft

                train_sft(task, tmp, steps=cfg.sft.steps, batch_size=cfg.sft.batch_size, lr=cfg.sft.lr,
                          seed=cfg.seed, init_dir=tmp)
    info = {"seconds": round(time.time() - t0, 1), "source": cfg.model.builder or cfg.model.path_or_id}
    sft_metrics = out / "sft_metrics.json"
    if sft_metrics.is_file():
        info["sft"] = json.loads(sft_metrics.read_text())
    atomic_write_json(run_dir(cfg) / "base.json", info)
    _log(f"base: ready in {info['seconds']} s -> {out}")
    return info


def _check_tokenizer(tok: Any, where: str) -> None:
    """Generation needs an EOS token (and padding, which falls back to EOS)."""
    if tok.eos_token_id is None:
        raise StageError(f"{where}: the tokenizer has no eos_token (generation needs one to stop); set one "
                         "(tokenizer.eos_token = ...) and save the tokenizer again")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token


def _safetensors_problem(path: Path) -> str | None:
    """Why a ``.safetensors`` file is torn (its header promises more bytes than it has), else None."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                return f"{path.name} is truncated ({size} bytes, header needs {8 + n})"
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as exc:
        return f"{path.name} has an unreadable header ({exc.__class__.__name__})"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"{path.name} is truncated ({size} bytes, its tensors need {need})"
    return None


def _check_model_dir(path: Path, what: str, fix: str) -> None:
    """Fail with one clear StageError when ``path`` is not a complete model folder (config, intact
    weights, tokenizer); ``fix`` says which stage rebuilds it."""
    from vpo.registry import IncompleteCheckpointError, check_checkpoint

    try:
        check_checkpoint(path)
    except IncompleteCheckpointError as exc:
        raise StageError(f"{what}: {exc}; {fix}") from None
    for weights in sorted(path.glob("*.safetensors")):
        problem = _safetensors_problem(weights)
        if problem:
            raise StageError(f"{what}: incomplete checkpoint {path}: {problem}; {fix}")


# -- train ---------------------------------------------------------------------------------------
def stage_train(cfg: PipelineConfig, arm_name: str | None = None, seed: int | None = None) -> dict[str, Any]:
    """Train the named arm (and seed), or every enabled arm and seed; resumes interrupted runs."""
    base = run_dir(cfg) / "base"
    if not base.is_dir():
        raise StageError(f"{base} has no model: run `vpo stage base --pipeline {cfg.name}` first")
    _check_model_dir(base, "base model", f"rebuild it with `vpo stage base --pipeline {cfg.name}`")
    task = _task(cfg)
    rows = load_rows(cfg, "train")
    from transformers import AutoTokenizer

    from vpo.train import train_arm

    _check_tokenizer(AutoTokenizer.from_pretrained(str(base)), f"base model {base}")
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
            max_completion_length=arm.completion_length(tr), num_weights=tr.num_weights, alpha=tr.alpha,
            sampler=tr.sampler, loss_type=tr.loss_type, gradient_accumulation_steps=tr.gradient_accumulation_steps,
            save_steps=tr.save_steps, logging_steps=tr.logging_steps, use_vllm=tr.generation_backend == "vllm",
        )
    return results


# -- evaluate ------------------------------------------------------------------------------------
def _policies(cfg: PipelineConfig) -> list[tuple[str, str, int, Path, int]]:
    """(run id, arm name, m, model dir, token limit) for the base (in each answer format the arms
    use) and every arm run."""
    out = []
    for m in sorted({a.m for a in cfg.enabled_arms}):
        limit = max(a.completion_length(cfg.trainer) for a in cfg.enabled_arms if a.m == m)
        out.append((f"base-m{m}", f"base-m{m}", m, run_dir(cfg) / "base", limit))
    for arm, _, rid in arm_runs(cfg):
        out.append((rid, arm.name, arm.m, run_dir(cfg) / "arms" / rid / "model", arm.completion_length(cfg.trainer)))
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
        def cell(key: str, k: int, e: Mapping[str, Any] = e) -> str:
            v = e[key].get(str(k))
            return "n/a" if v is None else f"{v['mean']:.3f} ± {v['std']:.3f}"

        lines.append(
            f"| {arm} | {len(e['runs'])} | " + " | ".join(cell("best_at_k", k) for k in ks) + " | "
            + " | ".join(cell("expected_weighted_best_at_k", k) for k in ks) + " | " + cell("pass_at_k", ks[-1])
            + f" | {e['reward_diversity']['mean']:.3f} ± {e['reward_diversity']['std']:.3f}"
            f" | {e['first_answer_mean']['mean']:.3f} | "
            f"{e['collapsed_runs']}/{len(e['runs'])} |")
    return "\n".join(lines) + "\n"


def _oracle(task: Any, rows: Sequence[Mapping[str, Any]], ks: Sequence[int]) -> dict[str, Any] | None:
    """Reference ceilings on the mean scalar for tasks that can compute them (route): the
    prompt-only greedy best-of-k (what k answers chosen without the hidden information can reach)
    and the full-information best. None for tasks without oracles."""
    curve_fn = getattr(task, "hedge_curve", None)
    if curve_fn is None or not rows or not ks:
        return None
    curves = np.array([curve_fn(r, max(ks)) for r in rows])
    return {"prompt_only_best_at_k": {str(k): float(curves[:, k - 1].mean()) for k in ks},
            "full_information": float(np.mean([task.best_scalar(r) for r in rows]))}


def _oracle_line(oracle: Mapping[str, Any] | None, ks: Sequence[int]) -> str:
    if not oracle:
        return ""
    pts = ", ".join(f"best@{k} {oracle['prompt_only_best_at_k'][str(k)]:.3f}" for k in ks)
    return (f"\nOracle (mean scalar; answers chosen from the prompt alone, greedy): {pts}; "
            f"best single route knowing the hidden lava: {oracle['full_information']:.3f}.\n")


def _plot(agg: Mapping[str, Any], ks: Sequence[int], path: Path, title: str,
          oracle: Mapping[str, Any] | None = None) -> None:
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
            (line,) = ax.plot(xs, ys, style, marker="o", label=f"{arm} (n={len(e['runs'])})")
            if len(e["runs"]) > 1:
                ax.fill_between(xs, lo, hi, alpha=0.15, color=line.get_color())
        if oracle and key == "best_at_k":
            ax.plot(list(ks), [oracle["prompt_only_best_at_k"][str(k)] for k in ks], ":", color="0.4",
                    label="oracle, prompt only")
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


def _save_npy(path: Path, array: np.ndarray) -> None:
    """``np.save`` through temp + rename (np.save itself writes in place)."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    atomic_write_bytes(path, buf.getvalue())


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
    per_run: dict[str, Any] = {}
    groups: dict[str, list[str]] = {}
    policies = _policies(cfg)
    for rid, _, _, model_dir, _ in policies:  # every input checked before hours of sampling start
        stage = "base" if rid.startswith("base") else "train"
        _check_model_dir(model_dir, f"policy {rid}", f"rebuild it with `vpo stage {stage} --pipeline {cfg.name}`")
    with atomic_dir(out) as tmp:  # the old eval/ stays whole until every file of the new one is written
        published_mode(tmp)
        (tmp / "vectors").mkdir()
        for rid, arm, m, model_dir, limit in tqdm(policies, desc="evaluate", unit="policy"):
            t0 = time.time()
            res, vectors = evaluate_policy(task, str(model_dir), rows, m=m, n_samples=ev.n_samples, ks=ev.k,
                                           temperature=ev.temperature,
                                           max_new_tokens=limit, seed=ev.seed,
                                           num_weights=ev.num_weights)
            res["seconds"] = round(time.time() - t0, 1)
            _save_npy(tmp / "vectors" / f"{rid}.npy", vectors)
            per_run[rid] = res
            groups.setdefault(arm, []).append(rid)
        # a run "collapsed to one strategy" when its reward-space diversity fell below a tenth of the
        # base model's (absolute 0.1 without a base evaluation)
        base_div = [r["reward_diversity"] for rid, r in per_run.items() if rid.startswith("base")]
        collapse = 0.1 * float(max(base_div)) if base_div else 0.1
        agg = _aggregate(per_run, groups, collapse_threshold=collapse)
        ks = [k for k in ev.k if all(str(k) in r["best_at_k"] for r in per_run.values())]
        oracle = _oracle(task, rows, ks)
        metrics = {"pipeline": cfg.name, "quick": cfg.quick, "n_problems": len(rows), "n_samples": ev.n_samples,
                   "k": list(ev.k), "collapse_threshold": collapse, "arms": agg, "runs": per_run,
                   "oracle": oracle}
        atomic_write_json(tmp / "metrics.json", metrics)
        curves = [{"arm": arm, "k": int(k), "best_at_k": e["best_at_k"][str(k)]["mean"],
                   "expected_weighted_best_at_k": e["expected_weighted_best_at_k"][str(k)]["mean"],
                   "pass_at_k": e["pass_at_k"][str(k)]["mean"]} for arm, e in agg.items() for k in ks]
        atomic_write_json(tmp / "curves.json", curves)
        table = _table(agg, ks) + _oracle_line(oracle, ks)
        atomic_write_text(tmp / "table.md", table)
        _plot(agg, ks, tmp / "best_at_k.png", f"{cfg.name}: held-out {ev.split}, {len(rows)} problems", oracle)
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
    fix = f"run `vpo stage train --pipeline {cfg.name}` first"
    for _, _, rid in arm_runs(cfg):  # all inputs checked before anything is registered
        metrics_path = run_dir(cfg) / "arms" / rid / "metrics.json"
        if not metrics_path.is_file():
            raise StageError(f"arm run {rid}: {metrics_path} is missing (training did not finish); {fix}")
        _check_model_dir(run_dir(cfg) / "arms" / rid / "model", f"arm run {rid}", fix)
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
    from vpo.registry import hash_checkpoint
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
    # "solved" = reaching the problem's best achievable scalar (route: 0.75), as the search counts it
    oracle = getattr(task, "best_scalar", None)
    target = {str(r["id"]): float(oracle(r)) if callable(oracle) else 1.0 for r in rows}
    per_arm: dict[str, dict[str, float]] = {}
    for rid in ev["runs"]:
        if rid.startswith("base"):
            continue
        vec = np.load(vectors_dir / f"{rid}.npy")
        scal = scalarise(vec, w_star)
        best = pool_best_at_k(scal, min(k_max, scal.shape[1] * scal.shape[2]))
        per_arm[rid] = {str(r["id"]): float(b) / target[str(r["id"])] for r, b in zip(rows, np.atleast_1d(best))}
    # the named "hardest" subset: no arm reaches the best achievable score at best@k_max (hardest first);
    # the search takes it first, then the next hardest by mean best@k_max, up to n_problems
    hard = hardest_subset(per_arm, k=k_max, threshold=1.0 - 1e-6) if per_arm else []
    mean_best = {pid: float(np.mean([v[pid] for v in per_arm.values()])) for pid in target}
    rest = sorted((pid for pid in target if pid not in set(hard)), key=lambda p: (mean_best[p], p))
    by_id = {str(r["id"]): r for r in rows}
    selected = [by_id[pid] for pid in (hard + rest)[: int(sc.params.get("n_problems", 8))]]
    out = run_dir(cfg) / "search"
    if sc.method == "openevolve":
        return _search_openevolve(cfg, task, selected, out)
    proposers = {}
    for arm, seed, rid in arm_runs(cfg):
        if seed == arm.seeds[0]:
            proposers[arm.name] = ModelProposer(str(run_dir(cfg) / "arms" / rid / "model"),
                                                max_new_tokens=arm.completion_length(cfg.trainer))
    m_of = {arm.name: arm.m for arm in cfg.enabled_arms}
    _reset_stale_search(out / "checkpoints", {
        "problems": [str(r["id"]) for r in selected], "budget": sc.budget, "iterations": sc.iterations,
        "seed": cfg.seed, "params": sc.params, "m": m_of,
        "models": {a: hash_checkpoint(p.model_dir)[0] for a, p in proposers.items()}})
    result = run_arms(task, selected, proposers, out, iterations=sc.iterations, m=m_of, budget=sc.budget,
                      seed=cfg.seed,
                      title=f"{cfg.name}: search on {len(selected)} held-out problems ({len(hard)} hardest first)",
                      **{k: v for k, v in sc.params.items() if k != "n_problems"})
    info = {"problems": [str(r["id"]) for r in selected], "hardest_subset": hard, "k_max": k_max}
    atomic_write_json(out / "selection.json", info)
    table = search_table(result["curves"], result["comparison"], hard, k_max)
    atomic_write_text(out / "table.md", table)
    _log("search: table\n" + table)
    return {**info, "result": result if isinstance(result, dict) else str(result)}


def _reset_stale_search(ck_dir: Path, key: dict[str, Any]) -> None:
    """Search checkpoints resume an interrupted search; a search whose problems, budget or models
    changed since (e.g. an arm was retrained) starts fresh instead."""
    import shutil

    key_file = ck_dir / "key.json"
    if ck_dir.exists():
        try:
            same = json.loads(key_file.read_text()) == json.loads(json.dumps(key, default=str))
        except (OSError, ValueError):
            same = False
        if not same:
            _log(f"search: settings or checkpoints changed since {ck_dir} was written; starting fresh")
            shutil.rmtree(ck_dir)
    ck_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(key_file, json.loads(json.dumps(key, default=str)))


def search_table(curves: Mapping[str, Any], comparison: Mapping[str, Any], hard: Sequence[str], k_max: int) -> str:
    """Markdown: problems solved and mean best score per search arm at the full budget (overall and
    on the hardest subset), then, per pair of arms, the problems one solves and the other does not."""
    n = next(iter(curves.values()))["n_problems"]
    hard_set = set(hard)
    caption = (f"Search on {n} held-out problems, hardest first; the hardest subset is the {len(hard)} problems "
               f"no arm solves at best@{k_max}. Equal budget of answer slots per problem and arm (an m-answer "
               f"policy spends m per call); candidates used = distinct parseable answers scored; solved = the "
               f"problem's best achievable score reached.")
    lines = [caption, "",
             f"| arm | solved | solved of the hardest {len(hard)} | mean best score | candidates used |",
             "|---|---|---|---|---|"]
    for arm, c in curves.items():
        on_hard = len(hard_set & set(c["solved_ids"]))
        lines.append(f"| {arm} | {c['final_solved']}/{c['n_problems']} | {on_hard} | {c['final_mean_best']:.3f} | "
                     f"{c['candidates_used']} |")
    lines += ["", "| pair (a vs b) | solved by a only | by b only | both | neither |", "|---|---|---|---|---|"]
    for pair, d in comparison.items():
        lines.append(f"| {pair} | {d['n_a_only']} | {d['n_b_only']} | {d['n_both']} | {d['n_neither']} |")
    return "\n".join(lines) + "\n"


def _search_openevolve(cfg: PipelineConfig, task: Any, rows: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """OpenEvolve on each selected problem with each arm's first-seed checkpoint: the checkpoint is
    served by vLLM's OpenAI-compatible server (``search.server_url`` host/port), one arm at a time."""
    from urllib.parse import urlparse

    from vpo.search.openevolve_bridge import VLLMServer, run_openevolve

    sc = cfg.search
    assert sc is not None
    url = urlparse(sc.server_url or "http://127.0.0.1:8000/v1")
    summary: dict[str, dict[str, Any]] = {}
    for arm, seed, rid in arm_runs(cfg):
        if seed != arm.seeds[0]:
            continue
        arm_out = out / "openevolve" / arm.name
        arm_out.mkdir(parents=True, exist_ok=True)
        with VLLMServer(run_dir(cfg) / "arms" / rid / "model", host=url.hostname or "127.0.0.1",
                        port=url.port or 8000, seed=cfg.seed, log_path=arm_out / "vllm.log") as srv:
            per = {str(r["id"]): run_openevolve(r, task, api_base=srv.base_url, model=srv.model,
                                                out_dir=arm_out / str(r["id"]), iterations=sc.iterations,
                                                seed=cfg.seed, task_name=cfg.task.name,
                                                task_params=cfg.task.params)
                   for r in rows}
        summary[arm.name] = {pid: {"solved": bool(v["solved"]), "best_score": float(v["best_score"])}
                             for pid, v in per.items()}
        _log(f"search[openevolve] {arm.name}: solved {sum(v['solved'] for v in summary[arm.name].values())}"
             f"/{len(rows)}")
    atomic_write_json(out / "openevolve.json", summary)
    return {"method": "openevolve", "arms": summary}


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
    """Run the stages in order in this process (the main job), holding the run folder's lock
    (:class:`vpo.locking.LockBusyError` at once if another run holds it); returns each stage's summary."""
    from vpo.locking import pipeline_lock

    results = {}
    with pipeline_lock(run_dir(cfg), run_dir(cfg).name):
        for name in stages:
            t0 = time.time()
            results[name] = STAGES[name](cfg)
            _log(f"stage {name} done in {time.time() - t0:.0f} s")
    return results

