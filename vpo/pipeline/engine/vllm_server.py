"""The generation server of a run in vLLM server mode, started and stopped by the train stage itself.

With ``trainer.use_vllm``, ``trainer.vllm_mode: server`` and ``execution.vllm_gpus: N`` the train stage
(on node 0 of a multi-node run) starts ``trl vllm-serve`` (``execution.vllm_command`` replaces it) on the
last N of its GPUs, waits up to ``trainer.vllm_server_timeout`` seconds for ``/health/`` to answer 200,
trains on the other GPUs, and stops the server's process group when training ends: on success, on an
error, on Ctrl-C and on SIGTERM (the command's signal handling stops every tracked child, and the
``finally`` here stops it again). A server that exits while the run trains interrupts the training at
once (a signal to the main thread, SIGTERM to the launched training processes), and the stage fails with
one line naming its exit status and log.
The server's output goes to ``logs/vllm-<run>-<time>.log`` in the run folder.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vpo.pipeline.engine.console import log, shown_path
from vpo.pipeline.engine.errors import StageError
from vpo.pipeline.engine.processes import descendants, kill_group, track, untrack

if TYPE_CHECKING:
    from vpo.pipeline.engine.context import StageContext

__all__ = ["DEFAULT_COMMAND", "ServerDied", "ServerSpec", "VLLMServer", "for_run", "serving", "split_devices"]

DEFAULT_COMMAND = ("trl", "vllm-serve", "--model", "{model}", "--host", "{host}", "--port", "{port}",
                   "--tensor_parallel_size", "{tp}", "--data_parallel_size", "{dp}")
"""TRL's generation server; ``execution.vllm_command`` replaces it (the same placeholders are filled in)."""

_POLL_S = 0.5


class ServerDied(Exception):
    """Raised in the main thread when the generation server exits while the run trains."""


@dataclass(frozen=True)
class ServerSpec:
    """How to start one generation server and where it answers."""

    command: tuple[str, ...]
    health_url: str
    timeout_s: float
    log: Path
    devices: tuple[str, ...] = ()
    label: str = "vLLM server"

    def env(self) -> dict[str, str]:
        """The server's environment: its GPUs only."""
        env = dict(os.environ)
        if self.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices)
        return env


def split_devices(visible: Sequence[str], reserved: int, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(training GPUs, server GPUs)``: the server takes the last ``reserved`` of ``visible``."""
    if reserved and len(visible) <= reserved:
        raise StageError(f"{where}: execution.vllm_gpus {reserved} leaves no GPU to train on ({len(visible)} visible"
                         f"{': ' + ','.join(visible) if visible else ''}); lower it or give the run more GPUs")
    cut = len(visible) - reserved
    return tuple(visible[:cut]), tuple(visible[cut:])


class VLLMServer:
    """One started server: :meth:`start`, :meth:`wait_healthy`, :meth:`watch` while training, :meth:`stop`."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.died: int | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Start the command in its own process group, output to the spec's log file."""
        self.spec.log.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.spec.log, "ab") as out:
                self.proc = track(subprocess.Popen(list(self.spec.command), env=self.spec.env(), stdout=out,
                                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                   start_new_session=True))
        except OSError as exc:
            raise StageError(f"{self.spec.label}: cannot start `{shlex.join(self.spec.command)}` ({exc.strerror or exc}); "
                             "install TRL's server (trl vllm-serve, vLLM's own environment: docs/gpu.md) or set "
                             "execution.vllm_command") from None
        log(f"{self.spec.label}: started `{shlex.join(self.spec.command)}` (pid {self.proc.pid}"
            + (f", GPU {','.join(self.spec.devices)}" if self.spec.devices else "")
            + f"); log: {shown_path(self.spec.log)}")

    def _exit_text(self, code: int) -> str:
        return f"killed by signal {-code}" if code < 0 else f"exited with {code}"

    def wait_healthy(self) -> float:
        """Poll the health URL until it answers 200; one :class:`StageError` if the server exits first or
        the timeout passes. Returns the seconds it took."""
        assert self.proc is not None
        t0 = time.monotonic()
        deadline = t0 + self.spec.timeout_s
        last = "no answer yet"
        while True:
            code = self.proc.poll()
            if code is not None:
                raise StageError(f"{self.spec.label} {self._exit_text(code)} before {self.spec.health_url} answered "
                                 f"(after {time.monotonic() - t0:.0f} s); see {shown_path(self.spec.log)}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise StageError(f"{self.spec.label} did not answer {self.spec.health_url} within "
                                 f"{self.spec.timeout_s:g} s (trainer.vllm_server_timeout; last: {last}); stopped it, "
                                 f"see {shown_path(self.spec.log)}")
            try:
                with urllib.request.urlopen(self.spec.health_url, timeout=max(0.1, min(5.0, left))) as resp:
                    if resp.status == 200:
                        seconds = time.monotonic() - t0
                        log(f"{self.spec.label}: healthy after {seconds:.1f} s at {self.spec.health_url}")
                        return seconds
                    last = f"HTTP {resp.status}"
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                last = str(reason) or reason.__class__.__name__
            time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    def watch(self, on_death: signal.Signals | None = signal.SIGUSR1) -> None:
        """From now on a server exit interrupts the main thread with ``on_death`` (see :func:`serving`)."""
        main = threading.main_thread().ident

        def loop() -> None:
            assert self.proc is not None
            while not self._stopping.is_set():
                code = self.proc.poll()
                if code is not None:
                    if not self._stopping.is_set():
                        self.died = code
                        if on_death is not None and main is not None:
                            signal.pthread_kill(main, on_death)
                    return
                self._stopping.wait(_POLL_S)

        self._watcher = threading.Thread(target=loop, name="vllm-server-watch", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL) and the watcher."""
        self._stopping.set()
        if self.proc is not None:
            running = self.proc.poll() is None
            kill_group(self.proc)
            untrack(self.proc)
            if running:
                log(f"{self.spec.label}: stopped (pid {self.proc.pid})")
        if self._watcher is not None:
            self._watcher.join(timeout=5)

    def death_text(self) -> str:
        """The one line of a server that exited mid-run."""
        return (f"{self.spec.label} {self._exit_text(self.died or 0)} while the run was training; the training was "
                f"stopped. See {shown_path(self.spec.log)}; the run resumes from its last checkpoint when started again")


def _stop_descendants() -> None:
    """SIGTERM every process this one started, directly or not: a training launched as a child (``accelerate
    launch`` and its ranks, in this process's group) must not outlive its server."""
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)


@contextlib.contextmanager
def serving(spec: ServerSpec) -> Iterator[VLLMServer]:
    """Start the server, wait until it is healthy, run the block, stop the server whatever happens. A server
    exit during the block raises :class:`StageError` (one line) in place of whatever the block raised."""
    server = VLLMServer(spec)
    in_main = threading.current_thread() is threading.main_thread()
    previous = None
    if in_main:
        def died(signum: int, frame: object) -> None:
            if not server._stopping.is_set():
                _stop_descendants()  # the training's launcher and its ranks, before anyone reaps the launcher
                raise ServerDied(server.death_text())

        previous = signal.signal(signal.SIGUSR1, died)
    try:
        server.start()
        server.wait_healthy()
        server.watch(signal.SIGUSR1 if in_main else None)
        try:
            yield server
        except ServerDied:
            raise StageError(server.death_text()) from None
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception:  # what the training raised once its server was gone (a refused connection)
            if server.died is not None:
                raise StageError(server.death_text()) from None
            raise
        if server.died is not None:
            raise StageError(server.death_text())
    finally:
        server.stop()
        if in_main and previous is not None:
            signal.signal(signal.SIGUSR1, previous)


def _fill(command: Sequence[str], values: dict[str, str]) -> tuple[str, ...]:
    out = []
    for word in command:
        try:
            out.append(word.format(**values))
        except (KeyError, IndexError, ValueError) as exc:
            raise StageError(f"execution.vllm_command: cannot fill in {word!r} ({exc.__class__.__name__}: {exc}); "
                             f"placeholders: {', '.join('{' + k + '}' for k in values)}") from None
    return tuple(out)


def spec_for(ctx: StageContext, devices: Sequence[str]) -> ServerSpec:
    """The server of a run of ``ctx``: its command filled in from the trainer's ``vllm_*`` settings, on
    ``devices``."""
    cfg, arm = ctx.cfg, ctx.arm_run.arm
    n = cfg.execution.vllm_gpus
    tp = arm.vllm_tensor_parallel_size
    if n % tp:
        raise StageError(f"pipeline {cfg.name!r}: execution.vllm_gpus {n} is not a multiple of "
                         f"trainer.vllm_tensor_parallel_size {tp}")
    host = arm.vllm_server_host
    values = {"model": str(ctx.layout.base), "host": host, "port": str(arm.vllm_server_port), "tp": str(tp),
              "dp": str(n // tp)}
    command = _fill(cfg.execution.vllm_command or DEFAULT_COMMAND, values)
    if cfg.execution.vllm_command is None:
        command += ("--gpu_memory_utilization", str(arm.vllm_gpu_memory_utilization))
        if arm.vllm_max_model_length:
            command += ("--max_model_len", str(arm.vllm_max_model_length))
    connect = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return ServerSpec(command, f"http://{connect}:{arm.vllm_server_port}/health/", float(arm.vllm_server_timeout),
                      ctx.layout.logs / f"vllm-{ctx.arm_run.rid}-{stamp}.log", tuple(devices),
                      f"{ctx.arm_run.rid}: vLLM server")


@contextlib.contextmanager
def for_run(ctx: StageContext, *, main_node: bool = True) -> Iterator[None]:
    """The generation server around a run's training when ``execution.vllm_gpus`` asks for one (node 0 of a
    multi-node run only); the training sees only the GPUs the server does not take."""
    n = ctx.cfg.execution.vllm_gpus
    if not n or not main_node:
        yield
        return
    from vpo.pipeline.engine.execution import Machine

    train_gpus, server_gpus = split_devices(Machine.detect().gpus, n, f"train@{ctx.arm_run.rid}")
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    with serving(spec_for(ctx, server_gpus)):
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(train_gpus)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before
