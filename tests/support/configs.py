"""A one-pipeline ``pipelines.yaml`` written to a test's folder and loaded: the route task on the tiny
embedded model with the trainer, arms and other sections a test names (for settings, pre-flight and
policy-loading tests that need a real :class:`PipelineConfig`, not a stand-in)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from vpo.pipeline import config as C

NAME = "p"
"""The pipeline's name in the written file."""


def write_pipeline(tmp_path: Path, trainer: dict[str, Any] | None = None, arms: list[dict[str, Any]] | None = None,
                   **sections: Any) -> C.PipelineConfig:
    """Write ``tmp_path/pipelines.yaml`` with one pipeline (default arm: VPO with three answers) and load it."""
    body = {"task": {"name": "route"}, "model": {"builder": "tiny"}, "trainer": trainer or {},
            "arms": arms or [{"name": "v", "estimator": "vpo", "num_answers": 3}], **sections}
    path = tmp_path / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "pipelines": {NAME: body}}))
    return C.load_pipeline(NAME, path)
