"""What a stage function gets: the config, the run layout, which step it is, the request's fingerprint
and the task (built once, its errors reported against ``task.params`` in the config file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from vpo.pipeline.config import ConfigError, PipelineConfig
from vpo.pipeline.config.layout import ArmRun, RunLayout

if TYPE_CHECKING:
    from vpo.pipeline.engine.state import Fingerprint
    from vpo.tasks import Task

__all__ = ["StageContext", "build_task"]


def build_task(cfg: PipelineConfig) -> Task:
    """The pipeline's task. A bad parameter value or a missing data file found by the task is one
    :class:`ConfigError` naming the config file, pipeline and ``task.params`` line."""
    from vpo.tasks import get_task

    try:
        return get_task(cfg.task.name, **cfg.task.params)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, OSError) as exc:
        key = _param_named(exc, cfg.task.params)
        raise cfg.problem(("task", "params", key) if key else ("task", "params"),
                          f"task {cfg.task.name!r} rejected its parameters: {exc}") from None


def _param_named(exc: BaseException, params: dict[str, Any]) -> str | None:
    """The parameter an error message names, if any (for the line number)."""
    text = str(exc)
    return next((k for k in params if k in text), None)


@dataclass
class StageContext:
    """One stage step's inputs: settings, paths, its run (train) and the fingerprint of the request."""

    cfg: PipelineConfig
    layout: RunLayout
    stage: str
    run: ArmRun | None = None
    fingerprint: Fingerprint | None = None
    progress: bool = True
    notes: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def task(self) -> Task:
        """The task, built on first use."""
        return build_task(self.cfg)

    def outcome(self, text: str) -> None:
        """What the stage produced, in a few words: shown on its ``done`` line (one line per stage end)."""
        self.notes["outcome"] = text

    def invalidate_record(self) -> None:
        """Drop the record of this step's current output before writing into it piecemeal, so a
        crash half-way leaves the output marked stale (outputs swapped whole need not call this)."""
        self.layout.state_file(self.stage, self.run.rid if self.run else None).unlink(missing_ok=True)

    @property
    def arm_run(self) -> ArmRun:
        """The run of a per-run stage (train)."""
        if self.run is None:
            raise ValueError("this stage step belongs to no arm run")
        return self.run
