"""Stage ``register``: every arm run's final model into the model registry.

The weights stay where DVC tracks them (each run's model folder is the artifact ``<variant>-<arm>-s<seed>``
of ``dvc.yaml``); the registry records an entry per run (content hash, metrics, lineage, settings) and
the model card, which is also written into the model folder. When HEAD's ``dvc.lock`` records these
very weights, a GTO version tag marks the commit; otherwise one line says why. Every input is read
and checked first, so one unreadable metrics file registers nothing rather than half the runs.
"""

from __future__ import annotations

from typing import Any

from vpo.atomic import atomic_write_json
from vpo.pipeline.config.layout import RunLayout, arm_runs
from vpo.pipeline.engine.checkpoints import check_model_dir
from vpo.pipeline.engine.console import detail, log
from vpo.pipeline.engine.context import StageContext
from vpo.pipeline.engine.inputs import read_json, stage_command
from vpo.pipeline.engine.storage import redact
from vpo.pipeline.registry.hub import push_runs

__all__ = ["run"]


def _base_model(cfg: Any) -> str | None:
    """The base model's Hub id when it came from the Hub (None for a local folder or a model built here)."""
    return cfg.model.path_or_id if cfg.model.path_or_id and not cfg.model.is_local_path else None


def run(ctx: StageContext) -> dict[str, Any]:
    """Register every enabled arm run; writes ``registry.json`` with the entries."""
    from vpo.pipeline.engine.checkpoints import content_hash
    from vpo.pipeline.registry import Registry

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
    lineage = {"base_hash": content_hash(layout.base), "base_model": _base_model(cfg), "pipeline": cfg.name,
               "quick": cfg.quick, "task": cfg.task.name}
    reg, rel = Registry(url, cfg.base_dir), RunLayout.relative(cfg)
    entries, unversioned = [], {}
    for r in arm_runs(cfg):
        entry, why = reg.register(
            layout.arm_model(r.rid), name=cfg.variant, arm=r.rid, path=rel.arm_model(r.rid).as_posix(),
            params=cfg.settings(), metrics={"train": inputs[r.rid], "eval": evals.get(r.rid, {})},
            lineage={**lineage, "arm_config": r.arm.name, "estimator": r.arm.estimator,
                     "num_answers": r.arm.num_answers, "seed": r.seed})
        entries.append(entry)
        if why:
            unversioned.setdefault(why, []).append(r.rid)
        detail(f"register: {entry.artifact} -> {entry.hash[:12]} {entry.version or '(no version)'}")
    for why, rids in unversioned.items():
        log(f"register: no GTO version for {', '.join(rids)}: {why}; the entries are kept in {redact(url)}")
    atomic_write_json(layout.registry_json, {"registry": url, "entries": [e.to_dict() for e in entries]})
    push_runs(cfg, layout, arm_runs(cfg), [e.hash for e in entries])
    ctx.outcome(f"{len(entries)} models in {redact(url)}: "
                + ", ".join(f"{e.artifact} {e.hash[:12]}" + (f" {e.version}" if e.version else "") for e in entries))
    return {"registry": url, "entries": len(entries)}
