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

from flows.flow_run import FlowRun, artifact_slug
from vpo.pipeline.config.layout import RunLayout
from vpo.pipeline.engine.console import mean_std
from vpo.pipeline.engine.storage import redact

__all__ = ["evaluation_md", "metrics_rows", "publish", "publish_failure", "registry_rows"]


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


def _k_max(metrics: dict[str, Any]) -> str | None:
    """The largest k every arm has (as the key string), or None."""
    arms = list(metrics.get("arms", {}).values())
    common = set.intersection(*(set(e.get("best_at_k") or {}) for e in arms)) if arms else set()
    return max(common, key=int) if common else None


def metrics_rows(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """One narrow table row per arm (means over seeds): best@1, best@k, E_w best@k and pass@k at the
    largest k, diversity, parse rate and collapsed runs (the report has the full curves)."""
    k = _k_max(metrics)
    rows = []
    for arm, e in metrics.get("arms", {}).items():
        row: dict[str, Any] = {"arm": arm, "runs": len(e.get("runs", []))}
        for key, label, ks in (("best_at_k", "best@", ("1", k)), ("expected_weighted_best_at_k", "E_w best@", (k,)),
                               ("pass_at_k", "pass@", (k,))):
            for kk in dict.fromkeys(ks):
                value = (e.get(key) or {}).get(kk) if kk is not None else None
                if value is not None:
                    row[f"{label}{kk}"] = round(float(value["mean"]), 3)
        for key, label in (("reward_diversity", "diversity"), ("parse_rate", "parse rate")):
            if key in e:
                row[label] = round(float(e[key]["mean"]), 3)
        if "collapsed_runs" in e:
            row["collapsed"] = f"{e['collapsed_runs']}/{len(e.get('runs', []))}"
        rows.append(row)
    return rows


def registry_rows(registry: dict[str, Any]) -> list[dict[str, Any]]:
    """One table row per registry entry: the run, its content hash, the git revision and dvc.lock hash
    it came from, its held-out metrics, and the model: its DVC artifact and GTO version."""
    rows = []
    for e in registry.get("entries", []):
        ev = (e.get("metrics") or {}).get("eval") or {}
        best = ev.get("best_at_k") or {}
        k = max(best, key=int) if best else None
        row: dict[str, Any] = {
            "run": e.get("arm"),
            "hash": (e.get("hash") or "")[:16],
            "git rev": (e.get("git_rev") or "")[:12] + ("+dirty" if e.get("git_dirty") else ""),
            "dvc.lock": (e.get("dvc_lock_sha256") or "")[:12] or "none",
        }
        if best:
            row["best@1"] = round(float(best["1"]), 3) if "1" in best else None
            row[f"best@{k}"] = round(float(best[k]), 3)
        if "reward_diversity" in ev:
            row["diversity"] = round(float(ev["reward_diversity"]), 3)
        # last: the long artifact name would push the metrics out of view in the UI's table
        row["model"] = f"{e.get('artifact') or ''} {e.get('version') or '(unversioned)'}".strip()
        rows.append(row)
    return rows


def _table_md(rows: list[dict[str, Any]], cols: list[str] | None = None) -> str:
    if not rows:
        return "_none_\n"
    cols = cols or list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def evaluation_md(metrics: dict[str, Any]) -> str:
    """The evaluation as three narrow tables (a wide one is cut off in the UI): best@k and E_w[best@k]
    per k (mean ± std over seeds), then pass@k, diversity, first answer, parse rate, collapsed."""
    arms = metrics.get("arms", {})
    ks = [k for k in map(str, metrics.get("k", [])) if all(k in (e.get("best_at_k") or {}) for e in arms.values())]

    def curve(key: str) -> list[dict[str, Any]]:
        return [{"arm": arm, **{f"k={k}": mean_std(e[key][k], len(e.get("runs", []))) for k in ks}}
                for arm, e in arms.items()]

    spread = ("mean ± std over seeds" if any(len(e.get("runs", [])) > 1 for e in arms.values())
              else "one seed per arm: no spread")
    k = ks[-1] if ks else None
    other = [{"arm": arm,
              f"pass@{k}": f"{e['pass_at_k'][k]['mean']:.3f}" if k and k in e.get("pass_at_k", {}) else "",
              "diversity": mean_std(e["reward_diversity"], len(e.get("runs", []))),
              "first answer": f"{e['first_answer_mean']['mean']:.3f}",
              "parse rate": f"{e['parse_rate']['mean']:.3f}" if "parse_rate" in e else "",
              "collapsed": f"{e.get('collapsed_runs', 0)}/{len(e.get('runs', []))}"} for arm, e in arms.items()]
    md = [f"**best@k** (mean scalar reward of the best of k candidates; {spread})", "",
          _table_md(curve("best_at_k")), "**E_w[best@k]** (w ~ Dirichlet)", "",
          _table_md(curve("expected_weighted_best_at_k")), "**pass@k, diversity, collapse**", "", _table_md(other)]
    oracle = metrics.get("oracle") or {}
    if oracle.get("prompt_only_best_at_k"):
        pts = ", ".join(f"best@{kk} {v:.3f}" for kk, v in oracle["prompt_only_best_at_k"].items())
        full = oracle.get("full_information", float("nan"))
        md += [f"Oracle (answers chosen from the prompt alone): {pts}; full information: {full:.3f}.", ""]
    return "\n".join(md)


def _header(run: FlowRun, lock_sha: str | None) -> list[str]:
    return [
        f"- pipeline `{run.pipeline}`{' (quick preset)' if run.quick else ''}, config `{run.config.name}`",
        f"- git revision `{_git_rev(run.repo) or 'n/a'}`" + (f", dvc.lock sha256 `{lock_sha[:16]}`" if lock_sha else ""),
        f"- mode: {run.mode_note}",
    ]


def publish_failure(run: FlowRun, completed: list[dict[str, Any]], failed: str, error: BaseException) -> None:
    """The report of a failed run (same artifact key as a successful one): which step failed, its error
    line and the end of its output, what completed before it, what did not run, how to go on."""
    slug = artifact_slug(run.variant)
    text = redact(str(error)).strip() or error.__class__.__name__
    first, *rest = text.splitlines()
    errors = [line.strip() for line in rest if line.strip().lower().startswith(("error:", "error "))]
    labels = [s.label for s in run.steps] + ["dvc-push", "register", "publish"]
    done = {r.get("stage") for r in completed}
    not_run = [label for label in labels if label not in done and label != failed]
    md = [f"# Retrain FAILED: `{run.variant}` at `{failed}`", "", *_header(run, None), "",
          f"**Error** ({error.__class__.__name__}): {first}", ""]
    if errors:  # the stage's own one-line error, as wrapping text (a code block is cut off on the right)
        md += [f"> {errors[-1]}", ""]
    if rest:  # the detail lines as wrapping text too: list items stay a list, other lines a quote
        md += [f"- {ln.strip()[2:]}" if ln.strip().startswith("- ") else f"> {ln.strip()}  "
               for ln in rest[-25:] if ln.strip()] + [""]
    md += ["## Completed", "", _table_md(completed) if completed else "_nothing_\n",
           "## Not run", "", ", ".join(f"`{label}`" for label in not_run) or "_nothing_", "",
           ("Fix the cause and run the flow again: completed stages are up to date and are not redone; a "
            "training run resumes from its last checkpoint.")]
    create_markdown_artifact(key=f"{slug}-report", markdown="\n".join(md),
                             description=f"{run.variant}: FAILED at {failed}")


@task(name="publish", cache_policy=NO_CACHE)
def publish(
    run: FlowRun,
    stages: list[dict[str, Any]],
    pulled: dict[str, Any] | None,
    pushed: dict[str, Any] | None,
    registry: dict[str, Any],
) -> dict[str, Any]:
    """Markdown report (best@k PNG inline, eval table, stages, lineage) and metrics/registry tables."""
    slug = artifact_slug(run.variant)
    layout = RunLayout(run.run_dir, run.variant)
    metrics = json.loads(layout.eval_metrics.read_text(encoding="utf-8"))
    m_rows, r_rows = metrics_rows(metrics), registry_rows(registry)
    create_table_artifact(
        key=f"{slug}-metrics",
        table=m_rows,
        description=f"{run.variant}: held-out evaluation per arm (mean over seeds; curves in the report)",
    )
    create_table_artifact(
        key=f"{slug}-registry",
        table=r_rows,
        description=f"{run.variant}: registered checkpoints (path, content hash, git revision, dvc.lock)",
    )
    png = layout.eval_plot
    lock_sha = _sha256(run.repo / "dvc.lock") if run.use_dvc else None
    md = [
        f"# Retrain report: `{run.variant}`",
        "",
        *_header(run, lock_sha),
        f"- DVC remote: {pushed['remote'] + ' (pushed)' if pushed else 'none configured'}",
        f"- registry: `{registry.get('registry', run.registry_url)}` ({len(r_rows)} entries)",
        "",
        "## best@k per arm",
        "",
    ]
    if png.is_file():
        md += [
            f"![best@k per arm](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode('ascii')})",
            "",
        ]
    cols = [c for c in ("run", "hash", "git rev", "dvc.lock") if any(c in r for r in r_rows)]
    cols += [c for c in dict.fromkeys(k for r in r_rows for k in r) if c not in cols and c != "path"]
    md += [
        "## Evaluation",
        "",
        evaluation_md(metrics),
        "## Stages",
        "",
        _table_md(stages),
        "## Registered checkpoints",
        "",
        _table_md(r_rows, cols),
        *[f"- `{r['run']}`: `{r['path']}`" for r in r_rows if r.get("path")],
        "",
    ]
    if pulled:
        md += [f"DVC pull from {pulled['remote']} took {pulled['seconds']} s."]
    create_markdown_artifact(
        key=f"{slug}-report", markdown=redact("\n".join(md)), description=f"{run.variant}: evaluation report"
    )
    return {"metrics": m_rows, "registry": r_rows, "stages": stages, "dvc_lock_sha256": lock_sha}
