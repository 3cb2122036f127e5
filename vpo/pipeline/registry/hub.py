"""Hugging Face model cards for registered models, and the optional upload of each run's final model
to the Hub (``trainer.push_to_hub``).

The card is ``huggingface_hub``'s ``ModelCard``: ``ModelCardData`` metadata (``base_model`` by hub id,
or by content hash for a model built here; ``library_name``; tags ``vpo``, ``trl`` and the estimator;
``model-index`` results from best@k, E_w[best@k] and pass@k) over a short markdown body. It is a
function of the registry entry alone, so a lost card can be re-made, and it shows only the settings
the run's estimator uses (each estimator's docstring names them: "Uses num_weights, alpha, ...").
The register stage writes it into the model folder (``README.md``, which ``.dvcignore`` keeps out of
DVC's hash of the train output), so an upload of that folder carries it. Without a token
(``HF_TOKEN`` or ``hf auth login``) nothing is uploaded and one line says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vpo.pipeline.config.layout import ArmRun, RunLayout
from vpo.pipeline.engine.console import log, tool
from vpo.pipeline.engine.errors import StageError
from vpo.pipeline.engine.inputs import stage_command

__all__ = ["estimator_uses", "hub_repo_id", "hub_token", "model_card", "push_runs"]

PAPER = "https://arxiv.org/abs/2605.22817"
_EVALS = (("best_at_k", "best"), ("expected_weighted_best_at_k", "E_w best"), ("pass_at_k", "pass"))


def hub_token() -> str | None:
    """The Hugging Face token the hub client would use (``HF_TOKEN``, or the one ``hf auth login`` saved)."""
    from huggingface_hub import get_token

    return get_token()


def hub_repo_id(prefix: str, rid: str) -> str:
    """``<prefix>-<arm>-s<seed>``: one Hub repo per training run."""
    return f"{prefix}-{rid}"


def estimator_uses(estimator: str) -> set[str]:
    """The inputs an advantage estimator reads, as it declares them when it registers."""
    from vpo.advantages import get_estimator

    return set(get_estimator(estimator).uses)


def _get(data: Any, *keys: str) -> Any:
    for k in keys:
        data = data.get(k) if isinstance(data, Mapping) else None
    return data


def _settings(entry: Any) -> list[tuple[str, Any]]:
    """(label, value) of the run's settings that its estimator actually uses."""
    lin, params = entry.lineage, entry.params
    arm = _get(params, "arms", str(lin.get("arm_config"))) or {}
    est = str(lin.get("estimator") or arm.get("estimator") or "")
    uses = estimator_uses(est) if est else set()
    trainer = params.get("trainer") or {}
    g = arm.get("num_generations", trainer.get("num_generations"))  # an arm lists only what it sets itself
    rows: list[tuple[str, Any]] = [("task", lin.get("task")), ("estimator", est or None),
                                   ("num_answers (answers per rollout)", lin.get("num_answers", arm.get("num_answers"))),
                                   ("G (rollouts per prompt)", g and g * int(arm.get("rollout_multiplier") or 1))]
    for key, label, value in (
            ("num_weights", "K (weightings per prompt group)", trainer.get("num_weights")),
            ("alpha", "α (Dirichlet concentration)", trainer.get("weight_alpha")),
            ("sampler", "weighting sampler", trainer.get("weight_sampler")),
            ("k", "k of max@k", arm.get("max_at_k_k") or (g and f"{max(2, g // 2)} (default)")),
            ("scale_rewards", "scale_rewards", arm.get("scale_rewards")),
            ("aggregation", "multi_objective_aggregation", arm.get("multi_objective_aggregation"))):
        if key in uses:
            rows.append((label, value))
    rows += [("seed", lin.get("seed")), ("max_steps", _get(entry.metrics, "train", "max_steps"))]
    return [(k, v) for k, v in rows if v is not None]


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def model_card(entry: Any) -> str:
    """The model card (README.md text) of a registry entry, built with ``huggingface_hub.ModelCard``."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    lin, ev = entry.lineage, _get(entry.metrics, "eval") or {}
    train = _get(entry.metrics, "train") or {}
    task, est = str(lin.get("task") or entry.name), str(lin.get("estimator") or "")
    split = str(_get(entry.params, "evaluation", "split") or "test")
    ks = sorted({int(k) for sub, _ in _EVALS for k in (ev.get(sub) or {}) if str(k).isdigit()})
    results = [EvalResult(task_type="text-generation", dataset_type=f"vpo/{task}", dataset_name=f"{task} (held-out)",
                          dataset_split=split, metric_type=sub, metric_name=f"{label}@{k}",
                          metric_value=round(float(v), 6), metric_args={"k": k})
               for sub, label in _EVALS for k in ks if isinstance(v := (ev.get(sub) or {}).get(str(k)), (int, float))]
    lora, merged = train.get("lora"), bool(train.get("merged"))
    adapter = any(f.path.startswith("adapter_") for f in entry.files)
    base = lin.get("base_model") or lin.get("base_hash")
    data = ModelCardData(
        base_model=base, library_name="peft" if adapter else "transformers", pipeline_tag="text-generation",
        tags=[t for t in ("vpo", "trl", est, task, "reinforcement-learning", "lora" if lora else None) if t],
        model_name=entry.artifact, eval_results=results or None,
        vpo={"artifact": entry.artifact, "content_hash": entry.hash, "version": entry.version,
             "base_model_hash": lin.get("base_hash"), "git_rev": entry.git_rev, "dvc_lock_sha256": entry.dvc_lock_sha256})
    if isinstance(lora, Mapping):
        lora_text = ", ".join(f"{k}={v}" for k, v in lora.items() if not isinstance(v, (list, dict)))
        weights = (f"LoRA adapters ({lora_text}) were trained and **merged** into the base weights: this folder "
                   "holds full weights and loads without peft." if merged else
                   f"This folder holds LoRA adapters ({lora_text}), not full weights: load them with peft onto "
                   f"the base model `{base}`.")
    else:
        weights = "All weights were trained (no adapters)."
    lines = [f"# {entry.artifact}", "",
             (f"Post-trained with [vpo]({PAPER}) (Vector Policy Optimization) through TRL: the `{est or '?'}` "
              f"advantage estimator on the `{task}` task, from base model `{base or 'not recorded'}`. {weights}"), "",
             "| setting | value |", "|---|---|", *[f"| {k} | {_fmt(v)} |" for k, v in _settings(entry)], "",
             "## Evaluation", ""]
    if ks:
        lines += [f"Held-out split `{split}`.", "", "| k | " + " | ".join(map(str, ks)) + " |", "|---|" + "---|" * len(ks)]
        lines += [f"| {label}@k | " + " | ".join(_fmt((ev.get(sub) or {}).get(str(k), "–")) for k in ks) + " |"
                  for sub, label in _EVALS if ev.get(sub)]
    else:
        lines.append("No evaluation metrics were recorded with this entry.")
    lines += ["", "## Lineage", "", f"- content hash (sha256 over weight and tokenizer files): `{entry.hash}`",
              f"- base model: `{base or 'not recorded'}`" + (f" (content hash `{lin['base_hash']}`)"
                                                             if lin.get("base_hash") and base != lin.get("base_hash") else ""),
              f"- git revision: `{entry.git_rev or 'unknown'}`" + (" (uncommitted changes)" if entry.git_dirty else ""),
              f"- DVC/GTO artifact `{entry.artifact}`" + (f", version `{entry.version}`" if entry.version else " (unversioned)"),
              "", "## Use", "", "```bash",
              *_use(entry), "```", ""]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))


def _use(entry: Any) -> list[str]:
    """The card's commands that get the model back, runnable as printed from a clone of the project
    (its root folder) with no virtualenv activated; the registry URL comes with them when it is remote."""
    registry = f" --registry {entry.registry_url}" if "://" in (entry.registry_url or "") else ""
    fetch = f"bin/vpo registry fetch{registry} {entry.artifact}@{entry.version or entry.hash[:12]} ./model"
    if not entry.version:
        return [fetch]
    return [fetch, f".venv/bin/dvc artifacts get . {entry.artifact} --rev {entry.version} -o ./model   # DVC alone"]


def push_runs(cfg: Any, layout: RunLayout, runs: Sequence[ArmRun], hashes: Sequence[str]) -> list[str]:
    """Upload every run's final model folder (its model card included) to its Hub repo (created if
    missing); returns the repo ids uploaded to (empty when the setting is off or no token is available)."""
    tr = cfg.trainer
    if not tr.push_to_hub:
        return []
    token = hub_token()
    repos = [hub_repo_id(tr.hub_model_id, r.rid) for r in runs]
    if not token:
        log(f"push_to_hub: no Hugging Face token (set HF_TOKEN or run `{tool('hf', 'auth', 'login')}`); skipped uploading "
            f"{len(repos)} run(s) to {tr.hub_model_id}-<run>")
        return []
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    done = []
    for run, repo, digest in zip(runs, repos, hashes):
        try:
            api.create_repo(repo, private=tr.hub_private_repo, exist_ok=True, repo_type="model")
            api.upload_folder(folder_path=str(layout.arm_model(run.rid)), repo_id=repo, repo_type="model",
                              commit_message=f"vpo {cfg.variant} {run.rid} (content hash {digest[:12]})")
        except Exception as exc:  # noqa: BLE001 (HTTP, auth and network errors alike: one clear line)
            raise StageError(f"push_to_hub: uploading {run.rid} to {repo} failed ({exc.__class__.__name__}: "
                             f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); the registry entry is "
                             f"kept, run `{stage_command(cfg, 'register')}` again to retry") from None
        done.append(repo)
    log(f"push_to_hub: uploaded {len(done)} run(s): {', '.join(done)}")
    return done
