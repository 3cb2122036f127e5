"""How the stages load a policy: the train stage's ``from_pretrained`` arguments (the run's
``model_init_kwargs``, TRL's name), and where and how evaluation and search sample one (device, dtype,
the vLLM engine's share of the GPU).

The train stage loads the base model itself (so TRL ignores ``model_init_kwargs`` for the policy): it
passes them on here, with TRL's meaning of each key, ``dtype`` defaulting to ``auto`` (the checkpoint's
dtype, what the memory plan assumes) and ``device_map`` allowed only where it is legal, a single
process without DeepSpeed or FSDP. What the model was loaded with goes into the run's record.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from vpo.pipeline.config.settings import distributed_type
from vpo.pipeline.engine.errors import StageError
from vpo.pipeline.engine.preflight import init_kwargs

if TYPE_CHECKING:
    from vpo.pipeline.config import ArmConfig, PipelineConfig

__all__ = ["DTYPES", "load_train_model", "sampling_options", "train_load_kwargs"]

DTYPES = ("auto", "bfloat16", "float16", "float32")
"""The ``model_init_kwargs.dtype`` values TRL accepts."""


def _where(cfg: PipelineConfig, arm: ArmConfig) -> str:
    own = "model_init_kwargs" in arm.model_fields_set
    return f"{'arms.' + arm.name if own else 'trainer'}.model_init_kwargs of pipeline {cfg.name!r}"


def train_load_kwargs(cfg: PipelineConfig, arm: ArmConfig, *, world: int) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments of one run of ``arm`` on ``world`` processes: its
    ``model_init_kwargs`` (the arm's, else the trainer's), ``dtype`` ``auto`` unless set,
    ``trust_remote_code`` from the setting of that name. A :class:`StageError` names the setting for a
    dtype TRL does not know, or a ``device_map`` under several processes, DeepSpeed or FSDP (each process
    holds its own copy or shard there; the launcher places it)."""
    kwargs = init_kwargs(arm.model_init_kwargs)
    if isinstance(arm.model_init_kwargs, str) and not kwargs and arm.model_init_kwargs.strip() not in ("", "{}"):
        raise StageError(f"{_where(cfg, arm)} is not a JSON object: {arm.model_init_kwargs!r}")
    dtype = kwargs.setdefault("dtype", "auto")
    if dtype not in DTYPES:
        raise StageError(f"{_where(cfg, arm)}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    kind = distributed_type(cfg)
    if kwargs.get("device_map") is not None and (world > 1 or kind in ("DEEPSPEED", "FSDP")):
        why = f"{world} processes" if world > 1 else f"distributed_type {kind}"
        raise StageError(f"{_where(cfg, arm)}: device_map {kwargs['device_map']!r} cannot be used with {why} (the "
                         "launcher places each process's copy or shard); remove device_map")
    kwargs.setdefault("device_map", None)
    kwargs.setdefault("trust_remote_code", bool(arm.trust_remote_code))
    return kwargs


def load_train_model(cfg: PipelineConfig, arm: ArmConfig, path: str | Path, *, world: int) -> tuple[Any, dict[str, Any]]:
    """The train stage's model from ``path`` with :func:`train_load_kwargs`, and its record: what was asked
    (``requested``) and what the loaded model has (``dtype``, ``attn_implementation``, ``device_map``)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = train_load_kwargs(cfg, arm, world=world)
    load = dict(kwargs)
    if load["dtype"] != "auto":
        load["dtype"] = getattr(torch, load["dtype"])
    model = AutoModelForCausalLM.from_pretrained(str(path), **load)
    record = {"requested": init_kwargs(arm.model_init_kwargs),
              "dtype": str(model.dtype).removeprefix("torch."),
              "attn_implementation": getattr(model.config, "_attn_implementation", None),
              "device_map": kwargs["device_map"]}
    return model, record


def sampling_options(cfg: PipelineConfig, *, cuda: bool | None = None) -> dict[str, Any]:
    """What evaluation and search pass to :func:`vpo.generation.sample`: the backend, ``load`` (the
    policy on this stage's device, :func:`vpo.generation.policy_device`, in the trainer's
    ``model_init_kwargs`` dtype, else the dtype it was saved in; its ``attn_implementation``) and
    ``engine`` (vLLM's share of the GPU, ``evaluation.vllm_gpu_memory_utilization``, and that dtype)."""
    from vpo.generation import policy_device

    ev = cfg.evaluation
    init = init_kwargs(cfg.trainer.model_init_kwargs)
    dtype = init.get("dtype", "auto")
    load: dict[str, Any] = {"device": policy_device(cuda), "dtype": dtype}
    if init.get("attn_implementation"):
        load["attn_implementation"] = init["attn_implementation"]
    engine: dict[str, Any] = {"gpu_memory_utilization": float(ev.vllm_gpu_memory_utilization)}
    if dtype != "auto":
        engine["dtype"] = dtype
    return {"backend": "vllm" if ev.use_vllm else "transformers", "load": load, "engine": engine}
