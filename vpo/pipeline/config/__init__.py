"""The configuration wing: ``pipelines.yaml`` read, checked and resolved into a :class:`PipelineConfig`.

What the rest of the pipeline (and a user's script) needs is named here; the modules hold the parts.
"""

from vpo.pipeline.config.schema import (
    DEFAULT_PATH,
    PARAMS_FILE,
    RUN_INDEPENDENT_ARM_KEYS,
    ArmConfig,
    ConfigError,
    PipelineConfig,
    TrainerConfig,
    deep_merge,
    load_all,
    load_pipeline,
    load_variant,
    load_yaml,
    pipeline_names,
    read_text,
    settings_digest,
    variant_settings,
)
