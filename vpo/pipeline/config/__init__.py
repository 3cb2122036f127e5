"""The configuration wing: ``pipelines.yaml`` read, checked and resolved into a :class:`PipelineConfig`.

:mod:`.source` reads a file (lines for errors), :mod:`.fields` declares every trainer setting,
:mod:`.sections` and :mod:`.schema` the rest of a pipeline, :mod:`.problems` words validation errors,
:mod:`.load` loads a pipeline, :mod:`.settings` turns an arm into a run's VPOConfig and batch, and
:mod:`.names` and :mod:`.layout` say where a run's files live. What other wings need is named here.
"""

from vpo.pipeline.config.load import (
    DEFAULT_PATH,
    apply_overrides,
    deep_merge,
    load_all,
    load_pipeline,
    pipeline_names,
)
from vpo.pipeline.config.schema import RUN_INDEPENDENT_ARM_KEYS, ArmConfig, PipelineConfig, TrainerConfig
from vpo.pipeline.config.source import ConfigError, load_yaml, read_text

__all__ = ["DEFAULT_PATH", "RUN_INDEPENDENT_ARM_KEYS", "ArmConfig", "ConfigError", "PipelineConfig",
           "TrainerConfig", "apply_overrides", "deep_merge", "load_all", "load_pipeline", "load_yaml",
           "pipeline_names", "read_text"]
