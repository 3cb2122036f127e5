"""The memory plan for a pipeline's arms: :mod:`vpo.memory` fed from the pipeline's settings.

Inputs, each read from the one place that owns it: the model's ``config.json`` (the built base model
when it exists, else the model folder, the Hugging Face cache, or a config shipped in
``vpo/data/model_configs`` for a hub id or GGUF file, so planning needs no download), the
:class:`~vpo.trainer.VPOConfig` keyword arguments the train stage builds (TRL's names: every
setting as the pipeline resolved it), ``trainer.lora``, the accelerate config file (ZeRO stage, FSDP, processes)
and the device (CUDA memory, else the RAM available).

``vpo plan`` prints the plan of every enabled arm, of the evaluation phase (:func:`evaluation_plan`) and
the pre-flight of this environment (:func:`main`); the train stage calls
:func:`check_plan` before it loads the model and stops with one error naming the setting to change.
``VPO_MEMORY_PLAN=warn`` turns that refusal into a warning (the estimate is coarse: benchmarks/memory_plan.py).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vpo.memory import (
    Device,
    GiB,
    LoraShape,
    MemoryPlan,
    ModelShape,
    Parallel,
    PlanError,
    TrainSettings,
    check,
    cpu_flops,
    device_by_name,
    format_bytes,
    format_plan,
    known_gpu,
    plan_step,
    ram,
)
from vpo.memory.evaluation import EvalPlan, check_evaluation, format_evaluation, plan_evaluation
from vpo.pipeline.config import PipelineConfig
from vpo.pipeline.config.layout import ArmRun, RunLayout
from vpo.pipeline.config.settings import accelerate_processes, deepspeed_zero, vpo_config_kwargs
from vpo.pipeline.engine.console import detail, log
from vpo.pipeline.engine.context import build_task
from vpo.pipeline.engine.errors import StageError
from vpo.pipeline.engine.inputs import stage_command

__all__ = ["MODEL_CONFIGS", "PLAN_ENV", "arm_plan", "check_plan", "evaluation_plan", "local_device", "model_shape",
           "parallel_of", "preflight_lines", "shipped_config"]

MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"
"""``config.json`` files of the models the presets name, so a plan needs no download."""
PLAN_ENV = "VPO_MEMORY_PLAN"
"""``warn``: the train stage logs a plan that does not fit instead of refusing to train."""


# ------------------------------------------------------------------------------------------- model


def shipped_config(name: str) -> Path | None:
    """The shipped ``config.json`` for a hub id (``org/Name``) or a GGUF file name
    (``Name.Q4_1.gguf``), matched on the model name, case-insensitively."""
    stem = name.rstrip("/").split("/")[-1]
    stem = re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE)
    stem = re.sub(r"[.-](Q\d\w*|F16|F32|BF16)$", "", stem, flags=re.IGNORECASE)
    for path in sorted(MODEL_CONFIGS.glob("*.json")):
        if path.stem.lower() == stem.lower():
            return path
    return None


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StageError(f"cannot read model config {path}: {exc}") from None


def _hub_cache_config(repo: str, revision: str | None) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo, "config.json", revision=revision)
    return Path(found) if isinstance(found, str) else None


def model_shape(cfg: PipelineConfig, layout: RunLayout | None = None) -> tuple[ModelShape, str, str]:
    """(shape, parameter dtype, where the config came from) of the pipeline's policy model."""
    layout = layout or RunLayout.of(cfg)
    m = cfg.model
    base_config = layout.base / "config.json"
    if base_config.is_file():
        config, source = _read_config(base_config), f"the base model ({layout.base})"
    elif m.builder == "tiny":
        from vpo.tiny import DEFAULT_SIZE, SPECIAL_TOKENS

        charset = build_task(cfg).charset
        config = {"model_type": "llama", "vocab_size": len(SPECIAL_TOKENS) + len(set(charset)),
                  "tie_word_embeddings": True, "dtype": "float32", **DEFAULT_SIZE, **m.builder_params}
        config["num_key_value_heads"] = config.get("num_key_value_heads") or config["num_attention_heads"]
        source = "the tiny builder's settings"
    elif m.path_or_id is not None:
        src = cfg.model_source
        path = Path(src) / "config.json" if Path(src).is_dir() else _hub_cache_config(src, m.revision)
        if path is None or not path.is_file():
            path = shipped_config(src)
        if path is None:
            raise StageError(f"no config.json for model {m.path_or_id!r}: not in the Hugging Face cache and none "
                             f"shipped in {MODEL_CONFIGS}; download it once (huggingface-cli download "
                             f"{m.path_or_id} config.json) or add it there")
        config, source = _read_config(path), str(path)
    else:
        assert m.gguf is not None
        name = m.gguf.file or Path(str(m.gguf.path)).name
        imported = layout.model_cache(f"{Path(name).stem}-{m.dtype}") / "config.json"
        path = imported if imported.is_file() else shipped_config(name)
        if path is None:
            raise StageError(f"no config.json for GGUF model {name!r}: run `{stage_command(cfg, 'base')}` once (it imports the "
                             f"file) or add its config to {MODEL_CONFIGS}")
        config, source = _read_config(path), str(path)
    shape = ModelShape.from_config(config, name=str(m.path_or_id or (m.gguf and (m.gguf.file or m.gguf.path))
                                                    or "tiny char model"))
    dtype = m.dtype if m.dtype != "auto" and not base_config.is_file() else (shape.dtype or "float32")
    if dtype not in ("float32", "bfloat16", "float16"):
        dtype = "float32"
    return shape, dtype, source


# ----------------------------------------------------------------------------------------- settings


def _lora(cfg: PipelineConfig) -> LoraShape | None:
    lora = getattr(cfg.trainer, "lora", None)
    if lora is None:
        return None
    return LoraShape(r=int(lora.r), alpha=float(lora.alpha), target_modules=tuple(lora.target_modules))


def _accelerate_file(cfg: PipelineConfig, value: str) -> Path:
    path = cfg.resolve_path(value)
    return path if path.is_file() else Path(value).expanduser().resolve()


def parallel_of(cfg: PipelineConfig, processes: int | None = None) -> Parallel:
    """ZeRO stage / FSDP and the number of processes from ``trainer.accelerate_config`` (single
    process without one); ``processes`` overrides the file's ``num_processes``."""
    value = cfg.trainer.accelerate_config
    if not value:
        return Parallel(world_size=processes or 1)
    import yaml

    path = _accelerate_file(cfg, value)
    try:
        acc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise StageError(f"trainer.accelerate_config {value!r}: cannot read {path} ({exc})") from None
    world = int(processes or acc.get("num_processes") or 1)
    kind = str(acc.get("distributed_type", "NO")).upper()
    if kind == "DEEPSPEED":
        try:
            zero = deepspeed_zero(cfg, acc, path)
        except ValueError as exc:
            raise StageError(f"trainer.accelerate_config {value!r}: {exc}") from None
        return Parallel(world_size=world, zero_stage=zero.stage, offload_optimizer=zero.offload_optimizer,
                        offload_params=zero.offload_params, source=str(path))
    if kind == "FSDP":
        fs = acc.get("fsdp_config") or {}
        return Parallel(world_size=world, fsdp=True, offload_params=bool(fs.get("fsdp_offload_params")),
                        offload_optimizer=bool(fs.get("fsdp_offload_params")), source=str(path))
    return Parallel(world_size=world, source=str(path))


# ------------------------------------------------------------------------------------------- device


def local_device() -> Device:
    """This machine's training device: the process's CUDA GPU (total memory, FLOP/s and bandwidth
    of the matching known card), else the CPU (total RAM, capped by a cgroup limit, with the RAM
    available now beside it; measured FLOP/s). On a CPU a plan must fit the RAM; one that exceeds
    what other processes leave free now is reported, not refused (it may well be free by then)."""
    import torch

    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        props = torch.cuda.get_device_properties(index)
        known = known_gpu(props.name, int(props.total_memory))
        return Device(props.name, int(props.total_memory), "cuda", known.flops if known else None,
                      known.bandwidth if known else None)
    threads = torch.get_num_threads()
    total, avail = ram()
    return Device(f"CPU ({threads} torch thread{'s' if threads != 1 else ''}, RAM)", total, "cpu", cpu_flops(), None,
                  available=avail)


def target_device(name: str | None = None, memory_gib: float | None = None, tflops: float | None = None) -> Device:
    """A named device (:data:`vpo.memory.DEVICES`), or this machine's; ``memory_gib`` and
    ``tflops`` override its memory and FLOP/s."""
    dev = device_by_name(name) if name else local_device()
    if memory_gib is not None:
        dev = Device(f"{dev.name} ({memory_gib:g} GiB)" if name else f"device with {memory_gib:g} GiB",
                     int(memory_gib * GiB), dev.kind if name else "cuda", dev.flops, dev.bandwidth)
    if tflops is not None:
        dev = Device(dev.name, dev.memory, dev.kind, tflops * 1e12, dev.bandwidth)
    return dev


# --------------------------------------------------------------------------------------------- plan


def _prompt_tokens(cfg: PipelineConfig) -> int:
    """The longest prompt in tokens: ``trainer.max_prompt_length`` (the train stage enforces it), else
    ``dataset.max_prompt_chars`` (a token is at least one character)."""
    limit = getattr(cfg.trainer, "max_prompt_length", None)
    return int(limit or cfg.dataset.max_prompt_chars)


def arm_plan(cfg: PipelineConfig, run: ArmRun, *, device: Device, parallel: Parallel | None = None,
             kwargs: Mapping[str, Any] | None = None, layout: RunLayout | None = None,
             shape: tuple[ModelShape, str, str] | None = None) -> MemoryPlan:
    """The plan of one arm run. ``kwargs``: the VPOConfig arguments (default: what the train stage
    would build; a built config's ``vars()`` also works)."""
    layout = layout or RunLayout.of(cfg)
    model, dtype, _ = shape or model_shape(cfg, layout)
    par = parallel or parallel_of(cfg)
    if kwargs is None:
        kwargs = vpo_config_kwargs(cfg, run, layout.arm_trainer(run.rid), cuda=device.is_cuda, progress=False)
    settings = TrainSettings.from_trl(kwargs, max_prompt_length=_prompt_tokens(cfg), param_dtype=dtype)
    try:
        plan = plan_step(model, settings, parallel=par, device=device, lora=_lora(cfg))
    except ValueError as exc:
        raise StageError(f"pipeline {cfg.name!r} arm {run.arm.name!r}: {exc}") from None
    reserved = cfg.execution.vllm_gpus
    if reserved:  # the server's GPUs are the run's too: say how many a node gives it and the training
        per_node = accelerate_processes(cfg) or 1
        plan.notes[:] = [n for n in plan.notes if not n.startswith("vLLM server mode:")]
        plan.notes.append(f"vLLM server mode: {reserved} GPU{'s' if reserved != 1 else ''} per run kept for the "
                          f"generation server (execution.vllm_gpus), not planned here; a node gives the run "
                          f"{per_node} training + {reserved} server = {per_node + reserved} GPUs")
    return plan


def check_plan(ctx: Any, args: Any) -> MemoryPlan:
    """The train stage's check before it loads the model: the plan of this arm run with the built
    VPOConfig ``args`` on this process's device. Raises :class:`StageError` naming the setting to
    change when it does not fit (``VPO_MEMORY_PLAN=warn``: log it and go on)."""
    cfg, run = ctx.cfg, ctx.arm_run
    values = {k: getattr(args, k) for k in TrainSettings.FIELDS if hasattr(args, k)}
    world = int(getattr(args, "world_size", 1) or 1)
    par = parallel_of(cfg, processes=world if cfg.trainer.accelerate_config else None)
    device = local_device()
    plan = arm_plan(cfg, run, device=device, parallel=par, kwargs=values, layout=ctx.layout)
    main_process = int(os.environ.get("RANK", "0")) == 0
    if main_process:
        detail(format_plan(plan, label=f"train@{run.rid}"))
    try:
        check(plan, label=f"train@{run.rid}", prefix="trainer.")
    except PlanError as exc:
        if os.environ.get(PLAN_ENV, "").lower() == "warn":
            if main_process:
                log(f"warning: {exc} ({PLAN_ENV}=warn: training anyway)")
            return plan
        raise StageError(f"{exc} (to train anyway: {PLAN_ENV}=warn)") from None
    if main_process and plan.above_available:
        log(f"warning: train@{run.rid}: the memory plan ({format_bytes(plan.peak)}) is more than the RAM free now "
            f"({format_bytes(device.available or 0)} of {format_bytes(device.memory)}); other processes hold the rest")
    if main_process:  # a plan that fits is the log file's (the console says only what needs a decision)
        step = f"; about {plan.step_seconds:.1f} s per step (estimated)" if plan.seconds else ""
        detail(f"train@{run.rid}: memory plan {format_bytes(plan.peak)} of {format_bytes(device.memory)} per device "
            f"({plan.verdict}){step}")
    return plan


def plan_pipeline(cfg: PipelineConfig, *, device: Device, processes: int | None = None, arm: str | None = None,
                  shape: tuple[ModelShape, str, str] | None = None) -> list[tuple[str, MemoryPlan]]:
    """(label, plan) for every enabled arm (first seed: seeds do not change memory)."""
    layout = RunLayout.of(cfg)
    shape = shape or model_shape(cfg, layout)
    par = parallel_of(cfg, processes)
    out = []
    for a in cfg.enabled_arms:
        if arm is not None and a.name != arm:
            continue
        run = ArmRun(a, a.seeds[0])
        out.append((f"{cfg.name}/{a.name}", arm_plan(cfg, run, device=device, parallel=par, layout=layout,
                                                     shape=shape)))
    if arm is not None and not out:
        raise StageError(f"pipeline {cfg.name!r} has no enabled arm {arm!r}; arms: "
                         f"{', '.join(a.name for a in cfg.enabled_arms)}")
    return out


def evaluation_plan(cfg: PipelineConfig, *, device: Device, shape: tuple[ModelShape, str, str] | None = None
                    ) -> tuple[str, EvalPlan]:
    """(label, plan) of the evaluation phase: the policy that needs the most memory (its rollouts per
    problem, ``ceil(n_samples / m)``, and completion length), sampled as the evaluate and search stages
    sample it (:func:`vpo.pipeline.engine.policy.sampling_options`: its dtype, transformers or vLLM)."""
    from vpo.pipeline.engine.preflight import init_kwargs

    model, saved_dtype, _ = shape or model_shape(cfg)
    ev = cfg.evaluation
    dtype = init_kwargs(cfg.trainer.model_init_kwargs).get("dtype", "auto")
    dtype = saved_dtype if dtype == "auto" else dtype
    best: tuple[str, EvalPlan] | None = None
    for a in cfg.enabled_arms:
        plan = plan_evaluation(model, device=device, dtype=dtype, prompt_tokens=_prompt_tokens(cfg),
                               completion_tokens=a.completion_length(cfg.trainer),
                               rollouts=math.ceil(ev.n_samples / a.num_answers),
                               problems=ev.max_problems or 10**9, backend="vllm" if ev.use_vllm else "transformers",
                               vllm_gpu_memory_utilization=ev.vllm_gpu_memory_utilization)
        if best is None or plan.peak > best[1].peak:
            best = (f"{cfg.name}/evaluation (largest policy: {a.name}, {ev.n_samples} samples per problem)", plan)
    assert best is not None  # a pipeline has at least one enabled arm
    return best


def preflight_lines(cfg: PipelineConfig, *, local: bool) -> list[str]:
    """``vpo plan``'s report of the pre-flight (:mod:`vpo.pipeline.engine.preflight`): this environment's
    packages, and with ``local`` (planning for this machine) its devices too."""
    from vpo.pipeline.engine import preflight

    return preflight.problems(cfg) if local else preflight.package_problems(cfg)


def main(cfg: PipelineConfig, *, device: str | None = None, memory_gib: float | None = None,
         tflops: float | None = None, processes: int | None = None, arm: str | None = None,
         as_json: bool = False) -> int:
    """``vpo plan``: print every arm's plan, the evaluation phase's and the pre-flight; exit 2 with one
    ``error:`` line per plan that does not fit (and, planning for this machine, per pre-flight problem)."""
    import sys

    dev = target_device(device, memory_gib, tflops)
    shape = model_shape(cfg)
    plans = plan_pipeline(cfg, device=dev, processes=processes, arm=arm, shape=shape)
    eval_label, eval_plan = evaluation_plan(cfg, device=dev, shape=shape)
    local = device is None and memory_gib is None
    pre = preflight_lines(cfg, local=local)
    if as_json:  # what the text shows, as one object: each arm's step, the evaluation phase, the pre-flight
        print(json.dumps({"arms": [_plan_json(label, p) for label, p in plans],
                          "evaluation": _eval_json(eval_label, eval_plan),
                          "preflight": {"of": "machine" if local else "packages", "problems": pre}}, indent=2))
    else:
        print(f"model config: {shape[2]}")
        for label, p in plans:
            print(format_plan(p, label=label))
        print(format_evaluation(eval_plan, label=eval_label))
        where = "of this machine" if local else "of this environment's packages (the plan is for another device)"
        print(f"pre-flight {where}: " + ("ok" if not pre else f"{len(pre)} problem{'s' if len(pre) != 1 else ''}"))
        for line in pre:
            print(f"  {line}")
    failed = 0
    for label, p in plans:
        try:
            check(p, label=label, prefix="trainer.")
        except PlanError as exc:
            print(f"error: {exc}", file=sys.stderr)
            failed += 1
    try:
        check_evaluation(eval_plan, label=eval_label)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        failed += 1
    if local and pre:
        print(f"error: pipeline {cfg.name!r} cannot run on this machine (pre-flight above)", file=sys.stderr)
        failed += 1
    return 2 if failed else 0


def _eval_json(label: str, p: EvalPlan) -> dict[str, Any]:
    return {"label": label, "device": p.device.name, "device_memory": p.device.memory, "dtype": p.dtype,
            "backend": p.backend, "sequences": p.sequences, "prompt_tokens": p.prompt_tokens,
            "completion_tokens": p.completion_tokens, "peak": p.peak, "verdict": p.verdict,
            "components": p.components, "runtime": p.runtime, "notes": p.notes}


def _plan_json(label: str, p: MemoryPlan) -> dict[str, Any]:
    return {"label": label, "device": p.device.name, "device_memory": p.device.memory,
            "device_available": p.device.available, "peak": p.peak,
            "peak_phase": p.peak_phase, "verdict": p.verdict, "components": p.components, "runtime": p.runtime,
            "phases": p.phase_totals, "flops": p.flops, "seconds": p.seconds, "parameters": p.model.parameters,
            "trainable": p.trainable, "world_size": p.parallel.world_size, "prompts_per_step": p.prompts_per_step,
            "generation_batch_size": p.generation_batch_size, "notes": p.notes}
