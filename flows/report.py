"""What a retrain flow run publishes in the Prefect UI: the report (markdown with the best@k plot, the
evaluation table, the stages, the registered checkpoints) and table artifacts of metrics and entries."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from flows.plan import Plan, artifact_slug
from vpo.pipeline.layout import RunLayout
from vpo.pipeline.storage import redact

__all__ = ["metrics_rows", "publish", "registry_rows"]


def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _git_rev(repo: Path) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def metrics_rows(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """One table row per arm: runs, best@k / E_w best@k / pass@k means and diversity."""
    rows = []
    for arm, e in metrics.get("arms", {}).items():
        row: dict[str, Any] = {"arm": arm, "runs": len(e.get("runs", []))}
        for key, label in (
            ("best_at_k", "best@"),
            ("expected_weighted_best_at_k", "E_w best@"),
            ("pass_at_k", "pass@"),
        ):
            for k, v in (e.get(key) or {}).items():
                row[f"{label}{k}"] = round(float(v["mean"]), 4)
        for key in ("reward_diversity", "first_answer_mean", "parse_rate"):
            if key in e:
                row[key] = round(float(e[key]["mean"]), 4)
        row["collapsed_runs"] = e.get("collapsed_runs")
        rows.append(row)
    return rows


def registry_rows(registry: dict[str, Any]) -> list[dict[str, Any]]:
    """One table row per registry entry with its lineage (hash, git rev, dvc.lock, arm, seed)."""
    rows = []
    for e in registry.get("entries", []):
        lineage = e.get("lineage") or {}
        best = ((e.get("metrics") or {}).get("eval") or {}).get("best_at_k") or {}
        rows.append(
            {
                "arm": e.get("arm"),
                "hash": (e.get("hash") or "")[:16],
                "estimator": lineage.get("estimator"),
                "num_answers": lineage.get("num_answers"),
                "seed": lineage.get("seed"),
                "git_rev": (e.get("git_rev") or "")[:12],
                "git_dirty": e.get("git_dirty"),
                "dvc_lock_sha256": (e.get("dvc_lock_sha256") or "")[:12],
                "files": len(e.get("files") or []),
                "size_bytes": e.get("size_bytes"),
                "best_at_k": json.dumps({k: round(float(v), 4) for k, v in best.items()}) if best else "",
                "created_at": e.get("created_at"),
            }
        )
    return rows


def _table_md(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "_none_\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


@task(name="publish", cache_policy=NO_CACHE)
def publish(
    plan: Plan,
    stages: list[dict[str, Any]],
    pulled: dict[str, Any] | None,
    pushed: dict[str, Any] | None,
    registry: dict[str, Any],
) -> dict[str, Any]:
    """Markdown report (best@k PNG inline, eval table, stages, lineage) and metrics/registry tables."""
    slug = artifact_slug(plan.variant)
    layout = RunLayout(plan.run_dir, plan.variant)
    metrics = json.loads(layout.eval_metrics.read_text(encoding="utf-8"))
    m_rows, r_rows = metrics_rows(metrics), registry_rows(registry)
    create_table_artifact(
        key=f"{slug}-metrics",
        table=m_rows,
        description=f"{plan.variant}: held-out evaluation per arm (mean over seeds)",
    )
    create_table_artifact(
        key=f"{slug}-registry",
        table=r_rows,
        description=f"{plan.variant}: registered checkpoints with lineage",
    )
    png = layout.eval_plot
    lock_sha = _sha256(plan.repo / "dvc.lock") if plan.use_dvc else None
    md = [
        f"# Retrain report: `{plan.variant}`",
        "",
        f"- pipeline `{plan.pipeline}`{' (quick preset)' if plan.quick else ''}, config `{plan.config.name}`",
        f"- git revision `{_git_rev(plan.repo) or 'n/a'}`"
        + (f", dvc.lock sha256 `{lock_sha[:16]}`" if lock_sha else ""),
        f"- mode: {plan.mode_note}",
        f"- DVC remote: {pushed['remote'] + ' (pushed)' if pushed else 'none configured'}",
        f"- registry: `{registry.get('registry', plan.registry_url)}` ({len(r_rows)} entries)",
        "",
        "## best@k per arm",
        "",
    ]
    if png.is_file():
        md += [
            f"![best@k per arm](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode('ascii')})",
            "",
        ]
    table = layout.eval_table
    md += [
        "## Evaluation",
        "",
        table.read_text(encoding="utf-8") if table.is_file() else _table_md(m_rows),
        "",
        "## Stages",
        "",
        _table_md(stages),
        "## Registered checkpoints",
        "",
        _table_md(r_rows),
    ]
    if pulled:
        md += [f"DVC pull from {pulled['remote']} took {pulled['seconds']} s."]
    create_markdown_artifact(
        key=f"{slug}-report", markdown=redact("\n".join(md)), description=f"{plan.variant}: evaluation report"
    )
    return {"metrics": m_rows, "registry": r_rows, "stages": stages, "dvc_lock_sha256": lock_sha}
