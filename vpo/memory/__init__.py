"""The memory plan: per-device memory and time of one GRPO/VPO optimizer step, before any model is loaded.

:mod:`.shapes` holds what a plan reads (model shape, LoRA, distributed layout, device, trainer
settings), :mod:`.estimate` the plan itself (:func:`plan_step`), the check that names the setting to
change (:func:`check`) and the report (:func:`format_plan`).
"""

from vpo.memory.estimate import (
    CPU_RUNTIME,
    DECODE_FLOOR_PER_LAYER,
    MemoryPlan,
    PlanError,
    check,
    format_bytes,
    format_plan,
    plan_step,
)
from vpo.memory.shapes import (
    DEVICES,
    Device,
    GiB,
    LoraShape,
    ModelShape,
    Parallel,
    TrainSettings,
    cpu_flops,
    device_by_name,
    known_gpu,
    ram,
    scale_shape,
    shape_config,
)

__all__ = ["CPU_RUNTIME", "DECODE_FLOOR_PER_LAYER", "DEVICES", "Device", "GiB", "LoraShape", "MemoryPlan", "ModelShape",
           "Parallel", "PlanError", "TrainSettings", "check", "cpu_flops", "device_by_name", "format_bytes",
           "format_plan", "known_gpu", "plan_step", "ram", "scale_shape", "shape_config"]
