"""One training run over several nodes: which node this is, the launch that joins it to the others,
and one line when a node or the rendezvous fails.

A run spans ``execution.nodes`` machines (else the accelerate config's ``num_machines``). Every node
runs the same command, ``vpo stage train --arm A --seed S`` (a work-pool flow run, a pod of a k8s
indexed Job, a Slurm task), told apart by the environment:

* :data:`NODE_RANK_ENV` (``VPO_NODE_RANK``; a k8s indexed Job's ``JOB_COMPLETION_INDEX`` or Slurm's
  ``SLURM_NODEID`` when unset): 0 .. nodes-1;
* :data:`MAIN_ADDR_ENV` / :data:`MAIN_PORT_ENV`: where node 0 listens (else the accelerate config's
  ``main_process_ip`` / ``main_process_port``, port 29500 by default).

Each node launches ``accelerate launch --num_machines N --machine_rank R --main_process_ip ...`` with
its share of the processes (the accelerate config's ``num_processes`` over its ``num_machines``), the
static rendezvous waiting ``execution.rendezvous_timeout`` seconds for the others. Node 0 holds global
rank 0: it writes checkpoints, publishes and records the run; the other nodes train and write nothing
of the run's outputs. Each rank's output is teed into ``logs/ranks/<run>-node<R>-<time>/`` of the node's
run folder. Each node's command also beats a heartbeat on node 0's port + 1 (:class:`Heartbeat`), so a
node lost mid-run is named by the others.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vpo.pipeline.config.settings import accelerate_processes, run_nodes
from vpo.pipeline.engine.console import log, shown_path
from vpo.pipeline.engine.errors import StageError
from vpo.pipeline.engine.processes import kill_group, track, untrack

if TYPE_CHECKING:
    from vpo.pipeline.config import PipelineConfig
    from vpo.pipeline.config.layout import ArmRun

__all__ = ["DEFAULT_PORT", "MAIN_ADDR_ENV", "MAIN_PORT_ENV", "NODE_RANK_ENV", "RANK_SOURCES", "Heartbeat", "NodeRole",
           "diagnose", "launch", "node_argv", "node_env", "node_role", "resume_text"]

NODE_RANK_ENV = "VPO_NODE_RANK"
MAIN_ADDR_ENV = "VPO_MAIN_ADDR"
MAIN_PORT_ENV = "VPO_MAIN_PORT"
RANK_SOURCES = (NODE_RANK_ENV, "JOB_COMPLETION_INDEX", "SLURM_NODEID")
"""Where a node reads its rank, first set wins: ours, a k8s indexed Job's pod index, Slurm's node id."""
DEFAULT_PORT = 29500

# what the launcher prints when the nodes never met, and when a peer vanished mid-run
_RENDEZVOUS = re.compile(r"Timed out after \d+ seconds waiting for clients|DistStoreError|"
                         r"failed to connect to|Connection refused.*(?:TCPStore|store)|"
                         r"RendezvousTimeoutError|clients joined", re.IGNORECASE)
_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|"
                        r"remote process exited|NCCL communicator was aborted|ProcessGroupGloo.*(?:closed|reset)|"
                        r"Socket Timeout|recvBytes|Gloo connectFullMesh failed", re.IGNORECASE)


@dataclass(frozen=True)
class NodeRole:
    """This machine's place in a multi-node run."""

    rank: int
    nodes: int
    per_node: int
    addr: str
    port: int
    rank_from: str
    timeout_s: int

    @property
    def world(self) -> int:
        """Processes of the whole run."""
        return self.per_node * self.nodes

    @property
    def is_main(self) -> bool:
        """Node 0: global rank 0 (checkpoints, publishing, the record)."""
        return self.rank == 0

    @property
    def ranks(self) -> str:
        """The global ranks on this node: ``2-3``."""
        first = self.rank * self.per_node
        return f"{first}-{first + self.per_node - 1}" if self.per_node > 1 else str(first)

    def others(self) -> list[int]:
        """The other nodes' ranks."""
        return [r for r in range(self.nodes) if r != self.rank]

    def launch_args(self, log_dir: Path | None = None) -> list[str]:
        """``accelerate launch`` options that make this node one machine of the run."""
        args = ["--num_machines", str(self.nodes), "--num_processes", str(self.world), "--machine_rank",
                str(self.rank), "--main_process_ip", self.addr, "--main_process_port", str(self.port),
                "--same_network", "--rdzv_backend", "static", "--rdzv_conf", f"timeout={self.timeout_s}"]
        if log_dir is not None:
            args += ["--tee", "3", "--log_dir", str(log_dir)]
        return args

    def describe(self) -> str:
        """``node 1 of 2 (ranks 2-3 of 4, node rank from VPO_NODE_RANK); rank 0 is node 0 at 10.0.0.5:29500``."""
        return (f"node {self.rank} of {self.nodes} (rank{'s' if self.per_node > 1 else ''} {self.ranks} of "
                f"{self.world}, node rank from {self.rank_from}); rank 0 is node 0 at {self.addr}:{self.port}")


def node_argv(arm: str, seed: int, *, pipeline: str | None = None, config: str = "pipelines.yaml",
              quick: bool = False, sets: Sequence[str] = ()) -> list[str]:
    """The ``vpo`` arguments every node of a run runs (the same on each): ``stage train`` of one run."""
    return ["stage", "train", "--config", config, *(["--pipeline", pipeline] if pipeline else []),
            *(["--quick"] if quick else []), "--arm", arm, "--seed", str(seed),
            *(word for item in sets for word in ("--set", item))]


def node_env(rank: int, main_addr: str, main_port: int = DEFAULT_PORT) -> dict[str, str]:
    """What tells the nodes of a run apart: the environment of node ``rank``."""
    return {NODE_RANK_ENV: str(rank), MAIN_ADDR_ENV: main_addr, MAIN_PORT_ENV: str(main_port)}


def _accelerate_value(cfg: PipelineConfig, key: str) -> object:
    import yaml

    if not cfg.trainer.accelerate_config:
        return None
    try:
        data = yaml.safe_load(cfg.resolve_path(cfg.trainer.accelerate_config).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return data.get(key) if isinstance(data, dict) else None


def node_role(cfg: PipelineConfig, env: Mapping[str, str] | None = None) -> NodeRole | None:
    """This node's role in a run of ``cfg`` (None: the run uses one node). One :class:`StageError` names
    what is missing or out of range."""
    env = os.environ if env is None else env
    nodes = run_nodes(cfg)
    if nodes == 1:
        return None
    where = f"pipeline {cfg.name!r}: a run over {nodes} nodes"
    if not cfg.trainer.accelerate_config:
        raise StageError(f"{where} needs trainer.accelerate_config (each node launches its processes through "
                         "`accelerate launch`; infra/accelerate/ has configs)")
    source = next((name for name in RANK_SOURCES if env.get(name, "").strip()), None)
    if source is None:
        raise StageError(f"{where}: this node's rank is not set; start each node with {NODE_RANK_ENV}=0..{nodes - 1} "
                         f"({', '.join(RANK_SOURCES[1:])} are read too) and {MAIN_ADDR_ENV} = node 0's address")
    text = env[source].strip()
    if not text.isdigit() or int(text) >= nodes:
        raise StageError(f"{where}: {source}={text!r} is not a node rank 0..{nodes - 1}")
    addr = env.get(MAIN_ADDR_ENV, "").strip() or str(_accelerate_value(cfg, "main_process_ip") or "")
    if not addr:
        raise StageError(f"{where}: node 0's address is not set; export {MAIN_ADDR_ENV} (an address every node "
                         "reaches) or set main_process_ip in trainer.accelerate_config")
    port_text = env.get(MAIN_PORT_ENV, "").strip() or str(_accelerate_value(cfg, "main_process_port") or DEFAULT_PORT)
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise StageError(f"{where}: main port {port_text!r} ({MAIN_PORT_ENV} or main_process_port) is not a TCP port")
    return NodeRole(int(text), nodes, accelerate_processes(cfg) or 1, addr, int(port_text), source,
                    cfg.execution.rendezvous_timeout)


def diagnose(role: NodeRole, output: Sequence[str], returncode: int, seconds: float, rid: str,
             resume: str, silent: Sequence[int] | None = None) -> str:
    """One line saying why this node's launch failed: the rendezvous (address and port it waited on), a
    node lost mid-run (which one -- ``silent``, from :class:`Heartbeat`, else the other node of two -- and
    the command that resumes), or the exit status."""
    text = "\n".join(output)
    head = f"{rid}: node {role.rank} of {role.nodes}"
    lost = _PEER_LOST.search(text)
    if _RENDEZVOUS.search(text) and not lost:
        missing = "node 0" if not role.is_main else ", ".join(f"node {r}" for r in (silent or role.others()))
        return (f"{head}: the rendezvous at {role.addr}:{role.port} timed out after {role.timeout_s} s ({missing} "
                f"never joined); start every node's command within execution.rendezvous_timeout, with "
                f"{MAIN_ADDR_ENV}={role.addr} {MAIN_PORT_ENV}={role.port} reachable from each")
    if lost or returncode < 0:
        other = ", ".join(f"node {r}" for r in (silent or role.others()))
        who = other if silent or role.nodes == 2 else f"one of {other}"
        if returncode < 0 and not lost:
            who, why = f"node {role.rank} (this one)", f"was killed by signal {-returncode}"
        else:
            why = f"stopped mid-run ({'their' if len(silent or ()) > 1 else 'its'} ranks' connections closed)"
        return f"{head}: {who} {why} after {seconds:.0f} s; {resume}"
    return (f"{head}: `accelerate launch` exited with {returncode} after {seconds:.0f} s (see the ranks' output "
            f"above); {resume}")


def resume_text(cfg: PipelineConfig, run: ArmRun, mirror: str | None) -> str:
    """How to resume a run after a node failed: its command on every node, and from where (the newest
    complete copy in ``mirror`` at this moment, else node 0's local checkpoints)."""
    from vpo.pipeline.engine.console import command
    from vpo.pipeline.engine.mirror import newest_complete

    newest = newest_complete(mirror) if mirror else None
    where = (f"from checkpoint-{newest.step} mirrored in storage.checkpoints" if newest else
             "from the newest checkpoint in storage.checkpoints (none mirrored yet)" if mirror else
             "from node 0's newest local checkpoint (set storage.checkpoints to survive losing it)")
    cmd = command("stage", "train", *cfg.cli_args(), "--arm", run.arm.name, "--seed", str(run.seed))
    return f"resume with `{cmd}` on every node (same {NODE_RANK_ENV} each); it resumes {where}"


class Heartbeat:
    """Each node's command counts up ``beat/<rank>`` in a small key-value store node 0 hosts on the port
    after the rendezvous port (torch's ``TCPStore``), once a second, beside its ranks. When a launch
    fails, :meth:`silent` names the nodes whose count stopped: the node that was lost, not a guess. A
    store that cannot be reached means node 0 (its host) is gone."""

    INTERVAL_S = 1.0

    def __init__(self, role: NodeRole) -> None:
        self.role = role
        self._store: object = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _connect(self) -> object:
        import datetime

        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=self.role.timeout_s)
        if self.role.is_main:
            return TCPStore("0.0.0.0", self.role.port + 1, None, True, timeout, wait_for_workers=False)
        return TCPStore(self.role.addr, self.role.port + 1, None, False, timeout)

    def _run(self) -> None:
        try:
            self._store = self._connect()
            while not self._stop.is_set():
                self._store.add(f"beat/{self.role.rank}", 1)  # type: ignore[attr-defined]
                self._stop.wait(self.INTERVAL_S)
        except Exception:  # noqa: BLE001 - the store's host is gone or unreachable: silent() says so
            return

    def _counts(self) -> dict[int, int]:
        store = self._store
        return {r: int(store.add(f"beat/{r}", 0)) for r in range(self.role.nodes)}  # type: ignore[attr-defined]

    def silent(self, wait_s: float = 3.0) -> list[int] | None:
        """The nodes whose beat stopped (over ``wait_s``); None when the store cannot tell."""
        if self._store is None:
            return None if self.role.is_main else [0]
        try:
            before = self._counts()
            time.sleep(wait_s)
            after = self._counts()
        except Exception:  # noqa: BLE001 - torch's DistNetworkError and kin: the host (node 0) is gone
            return None if self.role.is_main else [0]
        return [r for r in range(self.role.nodes) if r != self.role.rank and after[r] == before[r]]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _relay(stream: object, tail: collections.deque[str]) -> None:
    for raw in iter(stream.readline, ""):  # type: ignore[attr-defined]
        tail.append(raw.rstrip("\n"))
        sys.stdout.write(raw)
        sys.stdout.flush()


def launch(cmd: Sequence[str], env: Mapping[str, str], role: NodeRole, *, rid: str, log_dir: Path,
           resume: Callable[[], str]) -> None:
    """Run this node's ``accelerate launch`` (``cmd`` without the node options, which are added), relaying
    its output; a failure is one :class:`StageError` line from :func:`diagnose` (``resume()`` says how to
    resume, asked only then: the newest mirrored checkpoint is the one at that moment)."""
    head = list(cmd)
    at = head.index("--config_file") + 2
    full = [*head[:at], *role.launch_args(log_dir), *head[at:]]
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"{rid}: {role.describe()}; this node's rank logs: {shown_path(log_dir)}/ (one folder per local rank)")
    tail: collections.deque[str] = collections.deque(maxlen=400)
    heartbeat = Heartbeat(role)
    heartbeat.start()
    t0 = time.monotonic()
    proc = track(subprocess.Popen(full, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  errors="replace", start_new_session=True))
    reader = threading.Thread(target=_relay, args=(proc.stdout, tail), daemon=True)
    reader.start()
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:
            kill_group(proc)
        untrack(proc)
        reader.join(timeout=10)
    seconds = time.monotonic() - t0
    try:
        silent = heartbeat.silent() if code != 0 else None
    finally:
        heartbeat.stop()
    if code != 0:
        raise StageError(diagnose(role, list(tail), code, seconds, rid, resume(), silent))
    log(f"{rid}: node {role.rank} of {role.nodes} finished its ranks ({role.ranks})"
        + ("" if role.is_main else "; node 0 publishes the run"))
