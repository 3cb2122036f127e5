"""Stage ``register``: every arm run's final model into the checkpoint registry (local or ``s3://``).

Each entry records the checkpoint's content hash, the git revision, the ``dvc.lock`` hash, every
pipeline setting, the run's training and evaluation metrics and its lineage. Every input is read and
checked first, so one unreadable metrics file registers nothing rather than half the runs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from vpo.atomic import atomic_write_json
from vpo.pipeline.checkpoints import check_model_dir
from vpo.pipeline.console import detail
from vpo.pipeline.context import StageContext
from vpo.pipeline.hub import push_runs
from vpo.pipeline.inputs import read_json, stage_command
from vpo.pipeline.layout import arm_runs
from vpo.pipeline.storage import redact

__all__ = ["repo_root", "run"]


def repo_root(start: Path) -> Path:
    """The repository holding ``start`` (a folder with .git or dvc.yaml), else ``start``."""
    for p in [start, *start.parents]:
        if (p / ".git").exists() or (p / "dvc.yaml").exists():
            return p
    return start


def _entry_dict(entry: Any) -> dict[str, Any]:
    if hasattr(entry, "to_dict"):
        return entry.to_dict()
    return json.loads(json.dumps(dataclasses.asdict(entry), default=str))


def run(ctx: StageContext) -> dict[str, Any]:
    """Register every enabled arm run; writes ``registry.json`` with the entries."""
    from vpo.pipeline.registry import content_hash, register

    cfg, layout = ctx.cfg, ctx.layout
    url = cfg.resolve_url(cfg.storage.registry)
    evals: dict[str, Any] = {}
    if layout.eval_metrics.is_file():
        evals = read_json(layout.eval_metrics, f"rebuild it with `{stage_command(cfg, 'evaluate')}`")["runs"]
    inputs = {}
    for r in arm_runs(cfg):  # all inputs read and checked before anything is registered
        fix = f"retrain it with `{stage_command(cfg, 'train', r.rid)}`"
        inputs[r.rid] = read_json(layout.arm_metrics(r.rid), fix)
        check_model_dir(layout.arm_model(r.rid), f"arm run {r.rid}", fix)
    base_hash = content_hash(layout.base)
    entries = []
    for r in arm_runs(cfg):
        entry = register(url, layout.arm_model(r.rid), name=cfg.variant, arm=r.rid, params=cfg.params(),
                         metrics={"train": inputs[r.rid], "eval": evals.get(r.rid, {})},
                         lineage={"estimator": r.arm.estimator, "num_answers": r.arm.num_answers, "seed": r.seed,
                                  "pipeline": cfg.name, "quick": cfg.quick, "task": cfg.task.name},
                         base_hash=base_hash, repo_dir=repo_root(cfg.base_dir))
        entries.append(_entry_dict(entry))
        detail(f"register: {r.rid} -> {entries[-1].get('hash', '?')}")
    info = {"registry": url, "entries": entries}
    atomic_write_json(layout.registry_json, info)
    push_runs(cfg, layout, arm_runs(cfg), [str(e.get("hash", "")) for e in entries])
    ctx.outcome(f"{len(entries)} checkpoints in {redact(url)}: "
                + ", ".join(f"{r.rid} {e.get('hash', '?')[:12]}" for r, e in zip(arm_runs(cfg), entries)))
    return {"registry": url, "entries": len(entries)}
