"""The pre-flight of a pipeline: every package and device its settings need, checked before any stage runs.

:func:`features` reads which parts of the GPU path a pipeline's settings use (an accelerate config with
DeepSpeed, ``use_vllm``, LoRA, ``attn_implementation: flash_attention_2``, bf16/fp16) and which settings
ask for each; :func:`problems` turns them into one line per missing package or wrong version, with its
install command (the table in :mod:`vpo.requirements`), then one line per setting this machine cannot
honour (a GPU setting without a visible GPU, a missing accelerate config, a batch TRL cannot split).
``vpo run`` and ``vpo flow`` call :func:`check_preflight` before the data stage, ``vpo plan`` prints the
same lines, and each GPU-using stage calls :func:`check_hardware` again (``vpo stage``, ``dvc repro``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vpo import requirements as reqs
from vpo.pipeline.config.settings import (
    accelerate_processes,
    accelerate_settings,
    arm_batch,
    deepspeed_zero,
    distributed_type,
)
from vpo.pipeline.engine.errors import StageError
from vpo.pipeline.engine.execution import Machine

if TYPE_CHECKING:
    from vpo.pipeline.config import PipelineConfig

__all__ = ["GPU_STAGES", "check_hardware", "check_preflight", "features", "hardware_problems", "init_kwargs",
           "package_problems", "problems"]

GPU_STAGES = ("train", "evaluate", "search")
"""The stages that load a policy (and so may need the GPU path's packages)."""


def init_kwargs(value: Any) -> dict[str, Any]:
    """A ``model_init_kwargs`` setting as a mapping (TRL also takes it as a JSON string; None: empty)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return dict(value) if isinstance(value, dict) else {}


def _sections(cfg: PipelineConfig) -> list[tuple[str, Any]]:
    """``trainer`` and each enabled arm that sets a value of its own (an arm's resolved values repeat the
    trainer's: naming them again would only repeat the line)."""
    return [("trainer", cfg.trainer), *((f"arms.{a.name}", a) for a in cfg.enabled_arms)]


def _own(key: str, section: Any, name: str) -> bool:
    return key == "trainer" or name in section.model_fields_set


def features(cfg: PipelineConfig) -> dict[str, list[str]]:
    """Feature key of :data:`vpo.requirements.FEATURES` -> the settings of ``cfg`` that use it, for the
    features it uses (in the table's order)."""
    used: dict[str, list[str]] = {}

    def add(feature: str, setting: str) -> None:
        used.setdefault(feature, [])
        if setting not in used[feature]:
            used[feature].append(setting)

    acc = accelerate_settings(cfg)
    kind = distributed_type(cfg)
    for key, section in _sections(cfg):
        for flag in ("bf16", "fp16", "use_vllm"):
            if getattr(section, flag) and _own(key, section, flag):
                add("gpu", f"{key}.{flag}")
        if section.use_vllm and _own(key, section, "use_vllm"):
            add("vllm", f"{key}.use_vllm")
        attn = init_kwargs(section.model_init_kwargs).get("attn_implementation")
        if attn == "flash_attention_2" and _own(key, section, "model_init_kwargs"):
            add("flash_attention_2", f"{key}.model_init_kwargs.attn_implementation")
    if cfg.evaluation.use_vllm:
        add("gpu", "evaluation.use_vllm")
        add("vllm", "evaluation.use_vllm")
    if cfg.trainer.accelerate_config and kind in ("DEEPSPEED", "FSDP", "MULTI_GPU") and not acc.get("use_cpu"):
        add("gpu", f"trainer.accelerate_config ({kind})")
    if kind == "DEEPSPEED":
        add("deepspeed", f"trainer.accelerate_config {cfg.trainer.accelerate_config} (distributed_type DEEPSPEED)")
    if cfg.trainer.lora is not None:
        add("lora", "trainer.lora")
    if cfg.sft.enabled and cfg.sft.lora is not None:
        add("lora", "sft.lora")
    return {f: used[f] for f in reqs.FEATURES if f in used}


def package_problems(cfg: PipelineConfig, version_of: Callable[[str], str | None] = reqs.installed_version,
                     torch_cuda: str | None | bool = False) -> list[str]:
    """One line per package the pipeline's settings need that is missing or at a version outside its
    spec, naming the settings and the install command. ``torch_cuda``: ``torch.version.cuda`` of the
    installed torch to check against vLLM's wheel (False: read it here)."""
    used = features(cfg)
    why = {f: ", ".join(keys) + f" in pipeline {cfg.name!r}" for f, keys in used.items()}
    out = reqs.problems(reqs.needed(used), version_of=version_of, why=why)
    if "vllm" in used and version_of("vllm") is not None:
        if torch_cuda is False:
            import torch

            torch_cuda = torch.version.cuda
        line = reqs.torch_cuda_problem(torch_cuda if isinstance(torch_cuda, str) else None, uses_vllm=True)
        if line is not None:
            out.append(line)
    return out


def hardware_problems(cfg: PipelineConfig, *, cuda: bool | None = None) -> list[str]:
    """One line per setting this machine cannot honour: a GPU setting without a visible CUDA GPU, an
    accelerate config that does not exist, a batch TRL cannot split on the world size."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    where = f"pipeline {cfg.name!r}"
    out = []
    if not cuda:
        for key, section in _sections(cfg):
            if section.use_vllm and _own(key, section, "use_vllm"):
                out.append(f"{where}: {key}.use_vllm is true but no CUDA GPU is visible; vLLM generation needs one "
                           f"(set {key}.use_vllm: false on CPU machines)")
            for flag in ("bf16", "fp16"):
                if getattr(section, flag) and _own(key, section, flag):
                    out.append(f"{where}: {key}.{flag} is true but no CUDA GPU is visible; CPU training runs in "
                               f"float32 (set {key}.{flag}: false)")
        if cfg.evaluation.use_vllm:
            source = "" if "use_vllm" in cfg.evaluation.model_fields_set else " (from trainer.use_vllm)"
            out.append(f"{where}: evaluation.use_vllm is true{source} but no CUDA GPU is visible (set "
                       "evaluation.use_vllm: false on CPU machines)")
    reserved = cfg.execution.vllm_gpus
    if reserved and cuda:
        gpus, per_node = Machine.detect().gpus, accelerate_processes(cfg) or 1
        if len(gpus) < per_node + reserved:
            out.append(f"{where}: a run needs {per_node} training GPU{'s' if per_node != 1 else ''} "
                       f"(trainer.accelerate_config) + {reserved} for its vLLM server (execution.vllm_gpus) "
                       f"on this node, and {len(gpus)} {'is' if len(gpus) == 1 else 'are'} visible")
    tr = cfg.trainer
    if tr.accelerate_config and not Path(cfg.resolve_path(tr.accelerate_config)).is_file():
        out.append(f"{where}: trainer.accelerate_config {tr.accelerate_config!r} does not exist")
    elif tr.accelerate_config:
        kind, sharded = distributed_type(cfg), ""
        if kind == "DEEPSPEED":
            try:
                sharded = "ZeRO-3" if deepspeed_zero(cfg, accelerate_settings(cfg),
                                                     cfg.resolve_path(tr.accelerate_config)).stage == 3 else ""
            except ValueError as exc:
                out.append(f"{where}: trainer.accelerate_config {tr.accelerate_config!r}: {exc}")
        elif kind == "FSDP":
            sharded = "FSDP"
        if sharded and tr.lora is not None:
            out.append(f"{where}: trainer.lora with trainer.accelerate_config {tr.accelerate_config} ({sharded}) is "
                       "not supported: the merged model is made from whole weights on one process; use "
                       "infra/accelerate/deepspeed_zero2.yaml")
    for arm in cfg.enabled_arms:
        try:
            arm_batch(cfg, arm)
        except ValueError as exc:
            out.append(f"{where}: {exc}")
    return out


def problems(cfg: PipelineConfig, *, cuda: bool | None = None) -> list[str]:
    """Everything that stops ``cfg`` on this machine: the packages first, then the settings."""
    return package_problems(cfg) + hardware_problems(cfg, cuda=cuda)


def _raise(cfg: PipelineConfig, lines: Iterable[str], when: str) -> None:
    lines = list(lines)
    if not lines:
        return
    if len(lines) == 1:
        raise StageError(f"{lines[0]} ({when})")
    raise StageError(f"pipeline {cfg.name!r} cannot run on this machine ({when}):\n"
                     + "\n".join(f"  {line}" for line in lines))


def check_preflight(cfg: PipelineConfig, stages: Iterable[str] | None = None, *, cuda: bool | None = None) -> None:
    """Before the first stage of ``vpo run`` / ``vpo flow``: one :class:`StageError` listing every
    :func:`problems` line, when any of ``stages`` (default: all) loads a policy."""
    if stages is not None and not set(stages) & set(GPU_STAGES):
        return
    _raise(cfg, problems(cfg, cuda=cuda), "checked before any stage ran")


def check_hardware(cfg: PipelineConfig, *, cuda: bool | None = None) -> None:
    """The same check at the start of a stage that loads a policy (``vpo stage``, ``dvc repro``)."""
    _raise(cfg, problems(cfg, cuda=cuda), "checked before the stage started")
