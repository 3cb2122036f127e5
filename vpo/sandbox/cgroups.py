"""Per-sandbox cgroups: memory (tmpfs, shared memory and memfds included), a process count and a
CPU quota for each sandbox's whole process tree, on cgroup v2 or v1 (detected at start-up); where
the hierarchy has an io controller (v2 ``io``, v1 ``blkio``), a read/write limit on the block
devices the sandbox's view lives on; the CPU time a tree used (what time limits charge); and
killing a whole tree.

Layout, in every controller hierarchy used::

    <the creating process's own cgroup (v1), or its parent (v2)>/vpo/<pid>-<random>/s<slot>

``vpo`` is the project's parent group, ``<pid>-<random>`` one :class:`~vpo.sandbox.Sandbox`
instance, ``s<slot>`` one fork-server slot (a fork server runs one sandbox at a time; the sandbox
process joins the leaf itself before anything of the candidate runs). The groups sit under the
creator's own group, so every limit already on it (a container's, a CI job's) still applies.
Instance groups whose process died are removed at the next start-up.

``root`` arguments (default ``/``) let tests point everything at a scratch directory tree.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["CgroupError", "Hierarchy", "Instance", "Leaf", "Limits", "block_devices", "detect"]

PROJECT = "vpo"
REQUIRED = ("memory", "pids", "cpu")
OPTIONAL_V1 = ("cpuacct", "blkio")
_INSTANCE = re.compile(r"^(\d+)-[0-9a-f]{8}$")
_PERIOD_US = 100_000


class CgroupError(RuntimeError):
    """A cgroup could not be created, configured or joined."""


@dataclass(frozen=True)
class Limits:
    """What one leaf allows: bytes of memory (swap excluded from v2 / capped in v1), tasks
    (processes and threads) and CPUs (a CFS quota); where an io controller exists, bytes and
    operations per second read or written on each of ``io_devices`` (``"major:minor"`` of whole
    disks; None: no io limit)."""

    memory_bytes: int
    pids: int
    cpus: float
    io_bps: int | None = None
    io_iops: int | None = None
    io_devices: tuple[str, ...] = ()


def block_devices(paths: Iterable[str]) -> list[str]:
    """The whole disks (``"major:minor"``) the files at ``paths`` live on; file systems without a
    block device (tmpfs, overlay, network) give none. A partition is throttled through its disk."""
    out: set[str] = set()
    for p in paths:
        try:
            dev = os.stat(p).st_dev
        except OSError:
            continue
        major, minor = os.major(dev), os.minor(dev)
        if major == 0:
            continue
        sysdir = f"/sys/dev/block/{major}:{minor}"
        if os.path.exists(os.path.join(sysdir, "partition")):
            try:
                major, minor = map(int, _read(os.path.join(os.path.realpath(sysdir), "..", "dev")).split(":"))
            except (OSError, ValueError):
                continue
        elif not os.path.isdir(sysdir):
            continue
        out.add(f"{major}:{minor}")
    return sorted(out)


@dataclass(frozen=True)
class Hierarchy:
    """Where the project's parent group lives: ``dirs`` maps each controller to the directory of
    ``vpo`` in its hierarchy (one directory for all of them on v2)."""

    version: str
    dirs: dict[str, str]
    root: str = "/"

    def unique_dirs(self) -> list[str]:
        return sorted(set(self.dirs.values()))


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _mounts(root: str) -> list[tuple[str, str, str, list[str]]]:
    """(mount point, mount root, fstype, super options) of the cgroup mounts."""
    out = []
    for line in _read(os.path.join(root, "proc/self/mountinfo")).splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) < 5 or len(r) < 3 or r[0] not in ("cgroup", "cgroup2"):
            continue
        point = f[4].encode().decode("unicode_escape")
        out.append((os.path.join(root, point.lstrip("/")), f[3], r[0], r[2].split(",")))
    return out


def _own(root: str) -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under ``""`` its v2 path."""
    out = {}
    for line in _read(os.path.join(root, "proc/self/cgroup")).splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for ctrl in parts[1].split(",") if parts[1] else [""]:
            out[ctrl] = parts[2]
    return out


def _inside(point: str, mount_root: str, path: str) -> str | None:
    """The directory of cgroup ``path`` under a mount of the hierarchy's ``mount_root``."""
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root.rstrip("/") + "/")):
        return None
    rel = path[len(mount_root):] if mount_root != "/" else path
    return os.path.join(point, rel.lstrip("/")).rstrip("/") or point


def _v2(root: str, mounts: list, own: dict[str, str]) -> Hierarchy | str:
    v2 = [(p, r) for p, r, t, _ in mounts if t == "cgroup2"]
    if not v2 or "" not in own:
        return "no cgroup v2 hierarchy"
    point, mroot = v2[0]
    here = _inside(point, mroot, own[""])
    if here is None or not os.path.isdir(here):
        return "this process's cgroup v2 group is not visible"
    try:
        have = set(_read(os.path.join(here, "cgroup.controllers")).split())
    except OSError as exc:
        return f"cgroup v2: {exc.strerror or exc}"
    missing = [c for c in REQUIRED if c not in have]
    if missing:
        return f"cgroup v2 has no {'/'.join(missing)} controller"
    ctrls = REQUIRED + (("io",) if "io" in have else ())
    # a group holding processes (this one holds this process) cannot hand controllers to
    # children (v2's no-internal-process rule), the hierarchy's root excepted: the project's
    # group goes beside this process's own, under the same parent and its limits
    base = here if here == point else os.path.dirname(here)
    try:
        _enable(base, ctrls)
        group = os.path.join(base, PROJECT)
        with contextlib.suppress(FileExistsError):
            os.mkdir(group)
        _enable(group, ctrls)
        _set_weight("v2", group, _usable_cpus())
    except OSError as exc:
        return f"cgroup v2 at {base}: {exc.strerror or exc}"
    return Hierarchy("v2", {c: group for c in ctrls}, root)


def _usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except OSError:
        return max(1, os.cpu_count() or 1)


def _set_weight(version: str, group: str, tasks: int) -> None:
    """Give ``group`` the CPU weight of ``tasks`` ordinary processes. The scheduler shares CPU
    between groups level by level, so without this all sandboxes together would compete like a
    single process against everything else on a busy machine."""
    with contextlib.suppress(OSError):
        if version == "v2":
            _write(os.path.join(group, "cpu.weight"), str(min(10_000, 100 * tasks)))
        else:
            _write(os.path.join(group, "cpu.shares"), str(min(262_144, 1024 * tasks)))


def _enable(group: str, ctrls: Iterable[str] = REQUIRED) -> None:
    """Hand the memory, pids and cpu controllers (and io, where used) to ``group``'s children (v2)."""
    try:
        have = set(_read(os.path.join(group, "cgroup.subtree_control")).split())
    except FileNotFoundError:  # a scratch tree in tests; the kernel always has the file
        have = set()
    todo = " ".join(f"+{c}" for c in ctrls if c not in have)
    if todo:
        _write(os.path.join(group, "cgroup.subtree_control"), todo)


def _v1(root: str, mounts: list, own: dict[str, str]) -> Hierarchy | str:
    dirs: dict[str, str] = {}
    for ctrl in REQUIRED + OPTIONAL_V1:
        found = [(p, r) for p, r, t, opts in mounts if t == "cgroup" and ctrl in opts]
        if not found or ctrl not in own:
            if ctrl in REQUIRED:
                return f"cgroup v1 has no {ctrl} hierarchy"
            continue
        point, mroot = found[0]
        here = _inside(point, mroot, own[ctrl])
        if here is None or not os.path.isdir(here):
            if ctrl in REQUIRED:
                return f"cgroup v1: this process's {ctrl} group is not visible"
            continue
        group = os.path.join(here, PROJECT)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(group)
        except OSError as exc:
            if ctrl in REQUIRED:
                return f"cgroup v1: cannot create {group}: {exc.strerror or exc}"
            continue
        if ctrl == "cpu":
            _set_weight("v1", group, _usable_cpus())
        dirs[ctrl] = group
    return Hierarchy("v1", dirs, root)


def detect(root: str = "/") -> Hierarchy | str:
    """The hierarchy to use (v2 when it has the memory, pids and cpu controllers, else v1 when
    they are mounted there) and the project's parent group, created if needed; or why none can
    be used (a sentence)."""
    try:
        mounts = _mounts(root)
        own = _own(root)
    except OSError as exc:
        return f"cannot read this process's cgroups: {exc}"
    v2 = _v2(root, mounts, own)
    if isinstance(v2, Hierarchy):
        return v2
    v1 = _v1(root, mounts, own)
    if isinstance(v1, Hierarchy):
        return v1
    return f"{v2}; {v1}"


def _pids(files: Iterable[str]) -> list[int]:
    out: set[int] = set()
    for f in files:
        try:
            out.update(int(x) for x in _read(f).split())
        except (OSError, ValueError):
            continue
    return sorted(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Leaf:
    """One fork-server slot's group in every hierarchy: its sandbox process tree."""

    hier: Hierarchy
    dirs: dict[str, str]
    limits: Limits
    procs: list[str] = field(default_factory=list)
    oom_seen: int = 0  # OOM kills already attributed to a sandbox that ran here
    io: dict = field(default_factory=dict)  # the io limits in force here, or why there are none
    _cpu_fd: int = -1

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) used by every process that ever ran in this leaf; None where
        the hierarchy has no CPU accounting (v1 without cpuacct). Read through a descriptor kept
        open (one system call per reading: the parent reads it twice per test)."""
        if self.hier.version == "v2":
            path = os.path.join(self.dirs["cpu"], "cpu.stat")
        elif "cpuacct" in self.dirs:
            path = os.path.join(self.dirs["cpuacct"], "cpuacct.usage")
        else:
            return None
        try:
            if self._cpu_fd < 0:
                self._cpu_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            text = os.pread(self._cpu_fd, 4096, 0).decode()
            if self.hier.version == "v1":
                return int(text) / 1e9
            for line in text.splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
        except (OSError, ValueError):
            self.close()
        return None

    def close(self) -> None:
        if self._cpu_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._cpu_fd)
            self._cpu_fd = -1

    def oom_kills(self) -> int:
        """How many processes the memory limit killed here so far."""
        name = "memory.events" if self.hier.version == "v2" else "memory.oom_control"
        try:
            for line in _read(os.path.join(self.dirs["memory"], name)).splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def memory_peak(self) -> int | None:
        name = "memory.peak" if self.hier.version == "v2" else "memory.max_usage_in_bytes"
        try:
            return int(_read(os.path.join(self.dirs["memory"], name)))
        except (OSError, ValueError):
            return None

    def pids(self, exclude: Iterable[int] = ()) -> list[int]:
        """The processes in this leaf now (host pids), but ``exclude``."""
        skip = set(exclude)
        return [p for p in _pids(self.procs) if p not in skip]

    def kill(self, timeout: float = 5.0, exclude: Iterable[int] = ()) -> bool:
        """SIGKILL every process in the leaf but ``exclude`` (its fork server) and wait until
        none is left. A pid is signalled through a pidfd after checking that the process is
        still in this leaf, so a pid reused by an unrelated process is never hit. True when
        none is left."""
        return _kill_all(self.hier, sorted(set(self.dirs.values())), timeout, set(exclude))

    def remove(self) -> None:
        self.close()
        self.kill()
        for d in sorted(set(self.dirs.values()), reverse=True):
            _rmdir(d)


def _kill_all(hier: Hierarchy, dirs: list[str], timeout: float, exclude: set[int] | None = None) -> bool:
    """SIGKILL every process in groups ``dirs`` (and below) but ``exclude`` until none is left,
    or ``timeout``; True when none is left. Without exclusions on v2: ``cgroup.kill``. Otherwise
    each pid is signalled through a pidfd after checking that the process is still in one of
    these groups, so a pid reused by an unrelated process in the meantime is never hit."""
    exclude = exclude or set()
    if hier.version == "v2" and not exclude:
        for d in dirs:
            with contextlib.suppress(OSError):
                _write(os.path.join(d, "cgroup.kill"), "1")
    suffixes = tuple("/" + os.path.relpath(d, os.path.dirname(os.path.dirname(d.rstrip("/")))) for d in dirs)
    end = time.monotonic() + timeout
    delay = 0.0005
    while True:
        pids = [p for p in _pids(_procs_files(dirs)) if p not in exclude]
        if not pids:
            return True
        if time.monotonic() > end:
            return False
        for pid in pids:
            _kill_member(pid, suffixes)
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def _procs_files(dirs: list[str]) -> list[str]:
    """cgroup.procs of ``dirs`` and of their child groups."""
    files = []
    for d in dirs:
        for top, subdirs, _ in os.walk(d):
            files.append(os.path.join(top, "cgroup.procs"))
            subdirs[:] = [s for s in subdirs if os.path.exists(os.path.join(top, s, "cgroup.procs"))]
    return files


def _kill_member(pid: int, suffixes: tuple[str, ...]) -> None:
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        try:  # the process the pidfd names must still be in one of the groups (its pid may be reused)
            lines = _read(f"/proc/{pid}/cgroup").splitlines()
        except OSError:
            return
        paths = [line.split(":", 2)[-1] for line in lines]
        if not any(p.endswith(s) or (s + "/") in p for p in paths for s in suffixes):
            return
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)


def _rmdir(d: str, timeout: float = 2.0) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > end:
                return
            time.sleep(0.005)


class Instance:
    """The group of one Sandbox instance (``<pid>-<random>``) and its leaves."""

    def __init__(self, hier: Hierarchy, workers: int = 1) -> None:
        self.hier = hier
        self.name = f"{os.getpid()}-{secrets.token_hex(4)}"
        _remove_stale(hier)
        self.dirs: dict[str, str] = {}
        made: list[str] = []
        try:
            for ctrl, base in hier.dirs.items():
                d = os.path.join(base, self.name)
                if d not in made:
                    os.mkdir(d)
                    made.append(d)
                self.dirs[ctrl] = d
            if hier.version == "v2":
                _enable(self.dirs["memory"], list(hier.dirs))
            _set_weight(hier.version, self.dirs["cpu"], workers)
        except OSError as exc:
            for d in reversed(made):
                _rmdir(d)
            raise CgroupError(f"cannot create the sandbox's cgroup in {os.path.dirname(d)}: {exc.strerror or exc}") from None
        self.leaves: dict[int, Leaf] = {}

    def leaf(self, slot: int, limits: Limits) -> Leaf:
        """Create (or re-create) slot ``slot``'s leaf with ``limits``."""
        old = self.leaves.pop(slot, None)
        if old is not None:
            old.remove()
        dirs: dict[str, str] = {c: os.path.join(d, f"s{slot}") for c, d in self.dirs.items()}
        made: list[str] = []
        try:
            for d in dict.fromkeys(dirs.values()):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(d)
                made.append(d)
            leaf = Leaf(self.hier, dirs, limits, [os.path.join(d, "cgroup.procs") for d in made])
            _configure(leaf)
            leaf.io = _configure_io(leaf)
        except OSError as exc:
            for d in reversed(made):
                _rmdir(d)
            raise CgroupError(f"cannot configure the sandbox's cgroup {exc.filename or ''}: {exc.strerror or exc}") from None
        self.leaves[slot] = leaf
        return leaf

    def drop(self, slot: int) -> bool:
        """Kill slot ``slot``'s processes and remove its leaf. True when nothing was left alive;
        otherwise the leaf is kept, so that the next call kills again instead of reporting clean."""
        leaf = self.leaves.pop(slot, None)
        if leaf is None:
            return True
        leaf.close()
        if not leaf.kill():
            self.leaves[slot] = leaf
            return False
        for d in sorted(set(leaf.dirs.values()), reverse=True):
            _rmdir(d)
        return True

    def processes(self) -> list[int]:
        """Every process in this instance's groups now."""
        return _pids(_procs_files(sorted(set(self.dirs.values()))))

    def remove(self) -> None:
        for slot in list(self.leaves):
            self.drop(slot)
        for d in sorted(set(self.dirs.values()), reverse=True):
            _remove_tree(self.hier, d)


def _configure(leaf: Leaf) -> None:
    lim = leaf.limits
    mem, pids, cpu = leaf.dirs["memory"], leaf.dirs["pids"], leaf.dirs["cpu"]
    quota = max(1000, int(lim.cpus * _PERIOD_US))
    if leaf.hier.version == "v2":
        _write(os.path.join(mem, "memory.max"), str(lim.memory_bytes))
        for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
            if os.path.exists(os.path.join(mem, name)):
                _write(os.path.join(mem, name), value)
        _write(os.path.join(pids, "pids.max"), str(lim.pids))
        _write(os.path.join(cpu, "cpu.max"), f"{quota} {_PERIOD_US}")
        return
    _write(os.path.join(mem, "memory.limit_in_bytes"), str(lim.memory_bytes))
    memsw = os.path.join(mem, "memory.memsw.limit_in_bytes")
    if os.path.exists(memsw):  # memory + swap: nothing can be pushed to swap to get around it
        _write(memsw, str(lim.memory_bytes))
    _write(os.path.join(pids, "pids.max"), str(lim.pids))
    _write(os.path.join(cpu, "cpu.cfs_period_us"), str(_PERIOD_US))
    _write(os.path.join(cpu, "cpu.cfs_quota_us"), str(quota))


def _configure_io(leaf: Leaf) -> dict:
    """Write the leaf's io limits where its hierarchy has an io controller; returns what is in
    force (devices, bytes and operations per second) or why nothing is."""
    lim = leaf.limits
    ctrl = "io" if leaf.hier.version == "v2" else "blkio"
    if lim.io_bps is None and lim.io_iops is None:
        return {"why": "no io limit configured"}
    if ctrl not in leaf.dirs:
        return {"why": f"no {ctrl} controller in this cgroup hierarchy"}
    if not lim.io_devices:
        return {"why": "the sandbox's files are on no block device (tmpfs, overlay or network file system)"}
    d, done, failed = leaf.dirs[ctrl], [], []
    for dev in lim.io_devices:
        try:
            if leaf.hier.version == "v2":
                parts = [f"{k}={v}" for k, v in (("rbps", lim.io_bps), ("wbps", lim.io_bps), ("riops", lim.io_iops),
                                                 ("wiops", lim.io_iops)) if v is not None]
                _write(os.path.join(d, "io.max"), f"{dev} {' '.join(parts)}")
            else:
                for name, value in (("read_bps", lim.io_bps), ("write_bps", lim.io_bps), ("read_iops", lim.io_iops),
                                    ("write_iops", lim.io_iops)):
                    if value is not None:
                        _write(os.path.join(d, f"blkio.throttle.{name}_device"), f"{dev} {value}")
            done.append(dev)
        except OSError as exc:
            failed.append(f"{dev}: {exc.strerror or exc}")
    out: dict = {"devices": done, "bps": lim.io_bps, "iops": lim.io_iops}
    if failed:
        out["why"] = "cannot limit " + "; ".join(failed)
    return out


def _remove_tree(hier: Hierarchy, d: str) -> None:
    """Kill everything under group ``d`` and remove it, children first."""
    _kill_all(hier, [d], 5.0)
    with contextlib.suppress(OSError):
        for e in os.listdir(d):
            sub = os.path.join(d, e)
            if os.path.isdir(sub):
                _rmdir(sub)
    _rmdir(d)


def _remove_stale(hier: Hierarchy) -> None:
    """Remove the instance groups of processes that are gone (a crash, SIGKILL)."""
    for base in hier.unique_dirs():
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            m = _INSTANCE.match(name)
            if m and not _alive(int(m.group(1))):
                _remove_tree(hier, os.path.join(base, name))

