"""How many independent stages run at once, and what each one gets: torch threads and GPUs.

The independent stages of a pipeline are its arm x seed training runs (they read the same inputs and
write separate folders), and within the search stage, each arm's search. ``execution.max_parallel``
bounds how many run at once; by default it is derived from the machine and from what one run
declares it needs:

* **devices**: a run's GPUs: ``num_processes`` of its ``trainer.accelerate_config``, else 1 when a GPU
  is visible, else 0. Runs at once never exceed ``GPUs // devices``, and each concurrent run sees only
  its own GPUs (``CUDA_VISIBLE_DEVICES``).
* **threads**: a run's torch threads: ``execution.threads_per_stage``, else ``OMP_NUM_THREADS`` if set,
  else the cores divided by the runs that fit at once (``cores // min(runs, cores, GPU slots)``; on a
  2-core CPU machine with 4 runs: 1 thread each, 2 runs at once). The thread count never depends on
  ``max_parallel``, so a run's weights are the same whether it trained alone or beside others
  (tests/test_parallel.py checks it on the quick preset).
* **max_parallel** (default): ``min(runs, cores // threads, GPUs // devices)``, at least 1.

The same numbers serve ``vpo run`` (each concurrent run is its own ``vpo stage train`` process), the
Prefect flow (task fan-out) and the search stage (each arm a ``vpo stage search --arm A`` process); a
stage process reads its thread count from :data:`THREADS_ENV` when its parent set it, so all agree.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vpo.pipeline.config.layout import arm_runs
from vpo.pipeline.config.settings import accelerate_processes, arm_batch
from vpo.pipeline.engine.errors import StageError

if TYPE_CHECKING:
    from vpo.pipeline.config import PipelineConfig

__all__ = ["THREADS_ENV", "Concurrency", "Machine", "Slot", "check_hardware", "concurrency", "stage_threads",
           "torch_threads"]

THREADS_ENV = "VPO_STAGE_THREADS"
"""Set by a parent that runs stages concurrently: the torch threads of the stage process it starts."""


@dataclass(frozen=True)
class Machine:
    """What this process may use: its CPU cores (affinity, so cpusets count) and visible GPUs."""

    cores: int
    gpus: tuple[str, ...] = ()

    @classmethod
    def detect(cls) -> Machine:
        """Cores from the affinity mask; GPUs from ``CUDA_VISIBLE_DEVICES`` when set, else torch."""
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            gpus = tuple(d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1")
        else:
            try:
                import torch

                gpus = tuple(str(i) for i in range(torch.cuda.device_count())) if torch.cuda.is_available() else ()
            except ImportError:
                gpus = ()
        return cls(max(1, cores), gpus)


@dataclass(frozen=True)
class Slot:
    """One place a concurrent stage runs in: its thread count and its GPUs."""

    index: int
    threads: int
    devices: tuple[str, ...] = ()

    def env(self) -> dict[str, str]:
        """Environment of a stage process in this slot (threads for torch and its BLAS, its GPUs)."""
        n = str(self.threads)
        env = {THREADS_ENV: n, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}
        if self.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices)
        return env

    def describe(self) -> str:
        """``1 thread`` / ``4 threads, GPU 2,3``."""
        text = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        return text + (f", GPU {','.join(self.devices)}" if self.devices else "")


@dataclass(frozen=True)
class Concurrency:
    """How a group of independent stages runs: at most ``max_parallel`` at once, one slot each."""

    max_parallel: int
    threads: int
    devices_per_stage: int
    machine: Machine
    reason: str

    def slots(self) -> list[Slot]:
        """One slot per concurrent stage; GPUs dealt out in blocks of ``devices_per_stage``."""
        out = []
        for i in range(self.max_parallel):
            devices: tuple[str, ...] = ()
            if self.devices_per_stage and self.machine.gpus:
                devices = self.machine.gpus[i * self.devices_per_stage:(i + 1) * self.devices_per_stage]
            out.append(Slot(i, self.threads, devices))
        return out


def stage_devices(cfg: PipelineConfig, machine: Machine) -> int:
    """GPUs one training run uses: its accelerate processes, else 1 with a GPU, else 0."""
    if not machine.gpus:
        return 0
    return max(1, accelerate_processes(cfg) or 1)


def _env_threads(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None


def _fit(n_stages: int, machine: Machine, devices: int) -> int:
    """Stages that fit at once by cores and GPUs alone (at least 1)."""
    gpu_slots = len(machine.gpus) // devices if devices else n_stages
    return max(1, min(n_stages, machine.cores, gpu_slots))


def stage_threads(cfg: PipelineConfig, n_stages: int | None = None, machine: Machine | None = None) -> int:
    """The torch threads of one training run of ``cfg`` (see the module docstring): the parent's
    choice (:data:`THREADS_ENV`), ``execution.threads_per_stage``, ``OMP_NUM_THREADS``, or the cores
    divided among the runs that fit at once. Independent of ``max_parallel``."""
    from_parent = _env_threads(THREADS_ENV)
    if from_parent is not None:
        return from_parent
    if cfg.execution.threads_per_stage is not None:
        return cfg.execution.threads_per_stage
    from_env = _env_threads("OMP_NUM_THREADS")
    if from_env is not None:
        return from_env
    machine = machine or Machine.detect()
    n = n_stages if n_stages is not None else len(arm_runs(cfg))
    return max(1, machine.cores // _fit(max(1, n), machine, stage_devices(cfg, machine)))


def concurrency(cfg: PipelineConfig, n_stages: int, machine: Machine | None = None) -> Concurrency:
    """How ``n_stages`` independent training runs of ``cfg`` run on ``machine`` (default: this one)."""
    machine = machine or Machine.detect()
    devices = stage_devices(cfg, machine)
    threads = stage_threads(cfg, len(arm_runs(cfg)), machine)
    gpu_slots = len(machine.gpus) // devices if devices else math.inf
    hardware = f"{machine.cores} core{'s' if machine.cores != 1 else ''}" + (
        f", {len(machine.gpus)} GPU{'s' if len(machine.gpus) != 1 else ''}" if machine.gpus else ", no GPU")
    per_run = f"{threads} thread{'s' if threads != 1 else ''}" + (f", {devices} GPU{'s' if devices != 1 else ''}"
                                                                  if devices else "")
    if cfg.execution.max_parallel is not None:
        n = min(cfg.execution.max_parallel, n_stages)
        reason = f"execution.max_parallel {cfg.execution.max_parallel}"
        if n > gpu_slots:
            n = int(gpu_slots)
            reason += f", capped at {n} by {len(machine.gpus)} GPUs / {devices} per run"
    else:
        n = min(n_stages, max(1, machine.cores // threads), gpu_slots)
        reason = f"{hardware}, {per_run} per run"
    return Concurrency(max(1, int(n)), threads, devices, machine, reason)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the previous number."""
    import torch

    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_hardware(cfg: PipelineConfig, *, cuda: bool | None = None) -> None:
    """Fail with one :class:`StageError` naming the setting when this machine cannot honour it (a GPU
    setting on a CPU machine, a missing optional package or file, a batch TRL cannot split on the
    world size)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    where = f"pipeline {cfg.name!r}"
    runs = [("trainer", cfg.trainer), *((f"arms.{a.name}", a) for a in cfg.enabled_arms)]
    for key, section in runs:
        if section.use_vllm and importlib.util.find_spec("vllm") is None:
            raise StageError(f"{where}: {key}.use_vllm is true but vLLM is not installed (pip install 'vpo[vllm]', "
                             f"GPU machines only); set {key}.use_vllm: false to generate with transformers")
        if section.use_vllm and not cuda:
            raise StageError(f"{where}: {key}.use_vllm is true but no CUDA GPU is visible; vLLM generation needs "
                             f"one (set {key}.use_vllm: false on CPU machines)")
        for flag in ("bf16", "fp16"):
            if getattr(section, flag) and not cuda:
                raise StageError(f"{where}: {key}.{flag} is true but no CUDA GPU is visible; CPU training runs in "
                                 f"float32 (set {key}.{flag}: false)")
    tr = cfg.trainer
    if cfg.evaluation.use_vllm and importlib.util.find_spec("vllm") is None:
        raise StageError(f"{where}: evaluation.use_vllm is true but vLLM is not installed (pip install "
                         "'vpo[vllm]', GPU machines only); set evaluation.use_vllm: false to sample with transformers")
    if cfg.evaluation.use_vllm and not cuda:
        raise StageError(f"{where}: evaluation.use_vllm is true but no CUDA GPU is visible (set it to false on CPU)")
    if tr.accelerate_config and importlib.util.find_spec("accelerate") is None:
        raise StageError(f"{where}: trainer.accelerate_config is set but accelerate is not installed")
    if tr.accelerate_config and not Path(cfg.resolve_path(tr.accelerate_config)).is_file():
        raise StageError(f"{where}: trainer.accelerate_config {tr.accelerate_config!r} does not exist")
    if tr.lora is not None and importlib.util.find_spec("peft") is None:
        raise StageError(f"{where}: trainer.lora is set but peft is not installed (pip install 'vpo[chat]')")
    for arm in cfg.enabled_arms:
        try:
            arm_batch(cfg, arm)
        except ValueError as exc:
            raise StageError(f"{where}: {exc}") from None
