"""Sandbox harness: the fork server ("zygote") and the in-sandbox test runner.

This file runs as a script in a separate interpreter (``python -I -S -B _harness.py zygote FD``)
and must stay standard-library only and self-contained: isolated mode puts neither this folder
nor site-packages on ``sys.path``. The parent side (:mod:`vpo.sandbox.runner`) imports it only
for the value codec.

Process tree for one candidate::

    zygote Z (long-lived, one per worker, child subreaper)
      └─ H   forked per candidate: new session, unshares pid/mount/net/ipc/uts namespaces
          └─ C   pid 1 of the new pid namespace: mounts, drops to an unprivileged uid,
                 sets rlimits, then runs every test of the candidate in this one process

Z never runs candidate code. C streams one JSON line per event to a pipe the parent owns; the
parent decides pass/fail by comparing outputs itself, so nothing C says can turn a wrong answer
into a pass. Expected outputs never enter the sandbox.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import fcntl
import json
import math
import os
import resource
import select
import signal
import socket
import struct
import sys
import time

# ----------------------------------------------------------------------------------------------
# value codec: exact builtin types only, so candidate-defined __eq__/__repr__ never reach the judge

_TAGS = ("$t", "$s", "$fs", "$d", "$f", "$b", "$c")
MAX_DEPTH = 100


class CodecError(ValueError):
    """A value cannot be sent across the sandbox boundary (unsupported type, too deep)."""


def encode_value(x: object, depth: int = 0) -> object:
    """Encode a plain Python value as JSON-compatible data, preserving tuples, sets, non-string
    dict keys, bytes, complex and non-finite floats through tags. Subclasses of builtin types
    are rebuilt as their exact base type first, so the judge (in another process) only ever
    sees plain data and a candidate's ``__eq__`` or ``__repr__`` never takes part in the
    verdict; any other object is rejected."""
    if depth > MAX_DEPTH:
        raise CodecError("value nested too deeply")
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return x
    if t is float:
        if math.isfinite(x):
            return x
        return {"$f": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
    d = depth + 1
    if t is list:
        return [encode_value(v, d) for v in x]
    if t is tuple:
        return {"$t": [encode_value(v, d) for v in x]}
    if t is dict:
        return {"$d": [[encode_value(k, d), encode_value(v, d)] for k, v in dict.items(x)]}
    if t is set:
        return {"$s": [encode_value(v, d) for v in set.copy(x)]}
    if t is frozenset:
        return {"$fs": [encode_value(v, d) for v in frozenset.copy(x)]}
    if t is bytes:
        return {"$b": bytes.decode(x, "latin-1")}
    if t is complex:
        return {"$c": [encode_value(complex.__getattribute__(x, "real")), encode_value(complex.__getattribute__(x, "imag"))]}
    # Subclasses (Counter, namedtuple, IntEnum...): rebuild the exact base value and encode that.
    # Whatever a subclass's methods do here, what leaves the sandbox is plain data.
    for base in (int, float, str, list, tuple, dict, set, frozenset, bytes, complex):
        if isinstance(x, base):
            return encode_value(base(x), depth + 1)
    raise CodecError(f"unsupported value type {t.__module__}.{t.__qualname__}")


def decode_value(x: object, depth: int = 0) -> object:
    """Inverse of :func:`encode_value` (also accepts plain JSON: objects without a tag are
    ordinary dicts)."""
    if depth > MAX_DEPTH:
        raise CodecError("value nested too deeply")
    d = depth + 1
    if isinstance(x, list):
        return [decode_value(v, d) for v in x]
    if isinstance(x, dict):
        if len(x) == 1:
            (tag, v), = x.items()
            if tag == "$t":
                return tuple(decode_value(i, d) for i in v)
            if tag == "$s":
                return {_hashable(decode_value(i, d)) for i in v}
            if tag == "$fs":
                return frozenset(_hashable(decode_value(i, d)) for i in v)
            if tag == "$d":
                return {_hashable(decode_value(k, d)): decode_value(val, d) for k, val in v}
            if tag == "$f":
                return float(v)
            if tag == "$b":
                return v.encode("latin-1")
            if tag == "$c":
                return complex(float(v[0]), float(v[1]))
        return {k: decode_value(v, d) for k, v in x.items()}
    return x


def _hashable(v: object) -> object:
    if isinstance(v, list):
        return tuple(_hashable(i) for i in v)
    if isinstance(v, set):
        return frozenset(v)
    if isinstance(v, dict):
        raise CodecError("a dict cannot be a set element or dict key")
    return v


# ----------------------------------------------------------------------------------------------
# Linux primitives (ctypes; Python 3.11 has no os.unshare / mount wrappers)

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442  # same number on x86_64 and arm64
OPEN_TREE_CLONE, AT_RECURSIVE, AT_FDCWD, MOVE_MOUNT_F_EMPTY_PATH = 1, 0x8000, -100, 0x4
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 38, 36

_libc = None


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.syscall.restype = ctypes.c_long
        lib.unshare.argtypes = [ctypes.c_int]
        lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _libc = lib
    return _libc


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def unshare(flags: int) -> None:
    _check(_lib().unshare(flags), "unshare")


def mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_lib().mount(_b(src), _b(target), _b(fstype), flags, _b(data)), f"mount {target}")


def open_tree(path: str) -> int:
    flags = OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC
    return _check(_lib().syscall(ctypes.c_long(SYS_OPEN_TREE), ctypes.c_long(AT_FDCWD), _b(path), ctypes.c_long(flags)), f"open_tree {path}")


def move_mount(fd: int, target: str) -> None:
    lib = _lib()
    ret = lib.syscall(ctypes.c_long(SYS_MOVE_MOUNT), ctypes.c_long(fd), b"", ctypes.c_long(AT_FDCWD), _b(target),
                      ctypes.c_long(MOVE_MOUNT_F_EMPTY_PATH))
    _check(ret, f"move_mount {target}")


def mount_setattr(path: str, recursive: bool, attr_set: int, attr_clr: int) -> None:
    buf = ctypes.create_string_buffer(struct.pack("QQQQ", attr_set, attr_clr, 0, 0))
    ret = _lib().syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_long(AT_FDCWD), _b(path),
                         ctypes.c_long(AT_RECURSIVE if recursive else 0), buf, ctypes.c_long(32))
    _check(ret, f"mount_setattr {path}")


def prctl(option: int, arg: int) -> None:
    _check(_lib().prctl(option, arg, 0, 0, 0), f"prctl {option}")


def drop_capabilities() -> None:
    """Clear effective, permitted and inheritable capability sets (capset v3)."""
    header = ctypes.create_string_buffer(struct.pack("Ii", 0x20080522, 0))
    data = ctypes.create_string_buffer(bytes(24))
    _check(_lib().capset(header, data), "capset")


def _cap_eff() -> str:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return line.split()[1]
    except OSError:
        pass
    return "?"


# ----------------------------------------------------------------------------------------------
# zygote


HEADER = struct.Struct("<4sQ")
OP_RUN, OP_KILL = b"RUN ", b"KILL"
PRELOAD = (
    "typing", "collections", "heapq", "math", "itertools", "bisect", "functools", "string", "re",
    "random", "operator", "fractions", "decimal", "statistics", "array", "copy", "datetime", "json",
)


def _expose_paths() -> list[str]:
    """Directories the interpreter needs after the filesystem view is narrowed."""
    cands = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path]
    out: set[str] = set()
    for p in cands:
        if not p:
            continue
        p = os.path.realpath(p)
        if os.path.isfile(p):
            p = os.path.dirname(p)
        if os.path.isdir(p):
            out.add(p)
    keep = sorted(out)
    return [p for p in keep if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in keep)]


EXPOSE: list[str] = []


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        b = sock.recv(min(n - got, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _send_line(sock: socket.socket, obj: dict) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _children() -> list[int]:
    """Direct children of this (single-threaded) process, including adopted orphans."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        pass
    kids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == me:
            kids.append(int(name))
    return kids


def _reap_orphans() -> int:
    """Kill and reap every remaining child: orphans re-parented to this subreaper are
    descendants of a finished sandbox that escaped its session (or its pid namespace, where
    none exists). Returns how many were killed."""
    killed = 0
    for _ in range(100):
        kids = _children()
        if not kids:
            break
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        for pid in kids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    return killed


def _wait_child(pid: int, sock: socket.socket) -> tuple[int, bool]:
    """Wait for H while serving KILL requests; returns (wait status, parent_gone)."""
    pidfd = -1
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pass
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    if pidfd >= 0:
        poller.register(pidfd, select.POLLIN)
    gone = False
    try:
        while True:
            if pidfd < 0:
                wpid, status = os.waitpid(pid, os.WNOHANG)
                if wpid:
                    return status, gone
            events = poller.poll(None if pidfd >= 0 else 20)
            for fd, _ in events:
                if fd == pidfd:
                    return os.waitpid(pid, 0)[1], gone
                if fd == sock.fileno():
                    head = _recv_exact(sock, HEADER.size)
                    if head is None:  # parent died: kill the sandbox, then leave
                        gone = True
                        poller.unregister(sock.fileno())
                    if head is None or HEADER.unpack(head)[0] == OP_KILL:
                        _kill_tree(pid)
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _kill_tree(pid: int) -> None:
    for fn in (os.killpg, os.kill):
        try:
            fn(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def zygote_main(sock_fd: int) -> None:
    """Serve RUN requests forever: fork one sandbox per request, report its pid and exit status."""
    sock = socket.socket(fileno=sock_fd)
    for name in PRELOAD:
        __import__(name)
    _lib()
    EXPOSE[:] = _expose_paths()
    try:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        subreaper = True
    except OSError:
        subreaper = False
    _send_line(sock, {"hello": 1, "pid": os.getpid(), "euid": os.geteuid(), "expose": EXPOSE,
                      "subreaper": subreaper, "python": sys.version.split()[0]})
    zpid = os.getpid()
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, HEADER.size, 4)
        except OSError:
            break
        if not data:
            break
        if len(data) < HEADER.size:
            rest = _recv_exact(sock, HEADER.size - len(data))
            if rest is None:
                break
            data += rest
        op, length = HEADER.unpack(data)
        if op != OP_RUN or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            continue  # a late KILL for a finished run, or junk
        payload = _recv_exact(sock, length)
        if payload is None:
            break
        wfd = fds[0]
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(wfd)
            _send_line(sock, {"error": f"fork failed: {exc}"})
            continue
        if pid == 0:
            code = 70
            try:
                code = sandbox_main(payload, wfd, zpid)
            finally:
                os._exit(code)
        os.close(wfd)
        del payload
        _send_line(sock, {"pid": pid})
        status, gone = _wait_child(pid, sock)
        killed = _reap_orphans()
        if gone:
            break
        _send_line(sock, {"exit": _status_code(status), "orphans_killed": killed})
    _reap_orphans()


def _status_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return -1


# ----------------------------------------------------------------------------------------------
# H: namespaces, then fork C as pid 1


def _close_fds_from(lowest: int) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd >= lowest:
            try:
                os.close(fd)
            except OSError:
                pass


def sandbox_main(payload: bytes, wfd: int, zpid: int) -> int:
    """Runs in H (forked from the zygote). Returns H's exit code."""
    t_fork = time.time()
    os.setsid()
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != zpid:
        return 71
    high = fcntl.fcntl(wfd, fcntl.F_DUPFD, 10)
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.dup2(high, 3)
    _close_fds_from(4)
    cfg = json.loads(payload)
    del payload
    ns = cfg["namespaces"]
    mode = "none"
    flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    errors = []
    if ns != "off":
        if os.geteuid() == 0:
            try:
                unshare(flags)
                mode = "root"
            except OSError as exc:
                errors.append(str(exc))
        if mode == "none":
            uid, gid = os.geteuid(), os.getegid()
            try:
                unshare(flags | CLONE_NEWUSER)
                with open("/proc/self/setgroups", "w") as fh:
                    fh.write("deny")
                with open("/proc/self/uid_map", "w") as fh:
                    fh.write(f"{uid} {uid} 1")
                with open("/proc/self/gid_map", "w") as fh:
                    fh.write(f"{gid} {gid} 1")
                mode = "userns"
            except OSError as exc:
                errors.append(str(exc))
    cfg["_mode"] = mode
    cfg["_ns_errors"] = errors
    cfg["_t"] = [t_fork, time.time()]
    workdir = None
    if mode == "none":
        import tempfile
        workdir = tempfile.mkdtemp(prefix="vpo-sbx-")
        cfg["_workdir"] = workdir
    pid = os.fork()
    if pid == 0:
        code = 72
        try:
            code = child_main(cfg)
        except BaseException:  # noqa: BLE001 - any failure in C is reported by its exit code
            code = 73
        finally:
            os._exit(code)
    os.close(3)
    _, status = os.waitpid(pid, 0)
    if workdir is not None:
        import shutil
        shutil.rmtree(workdir, ignore_errors=True)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 74


# ----------------------------------------------------------------------------------------------
# C: filesystem view, credentials, limits, then the tests

_os_write = os.write
_json_dumps = json.dumps
_perf = time.perf_counter


def _send(obj: dict) -> None:
    data = _json_dumps(obj, ensure_ascii=True).encode() + b"\n"
    view = memoryview(data)
    while view:
        n = _os_write(3, view)
        view = view[n:]


def _setup_mounts(cfg: dict, mode: str, prot: dict) -> None:
    """Private mount tree: every configured secret dir hidden under an empty read-only tmpfs (the
    interpreter's own dirs re-exposed at the same paths), the whole tree read-only and nosuid,
    fresh private tmpfs on /tmp and /dev/shm, and a /proc for the new pid namespace."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    scratch = ["/tmp", "/dev/shm"]
    hides = [h for h in cfg["hide"] if os.path.lexists(h) and h not in scratch]
    under = lambda p, q: p == q or p.startswith(q.rstrip("/") + "/")
    covered = hides + scratch
    clones: dict[str, int] = {}
    for e in EXPOSE:
        if any(under(e, h) for h in covered):
            try:
                clones[e] = open_tree(e)
            except OSError as exc:
                prot["warnings"].append(f"cannot re-expose {e}: {exc}")
                hides = [h for h in hides if not under(e, h)]
    hidden = []
    for h in hides:
        try:
            if os.path.isdir(h) and not os.path.islink(h):
                mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "size=256k,nr_inodes=512,mode=755")
            else:
                mount("/dev/null", h, None, MS_BIND)
            hidden.append(h)
        except OSError as exc:
            prot["warnings"].append(f"cannot hide {h}: {exc}")
    size = int(cfg["tmp_mb"])
    for s in scratch:
        if os.path.isdir(s):
            mount("tmpfs", s, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size}m,nr_inodes=4096,mode=1777")
    prot["private_tmp"] = True
    for e, fd in sorted(clones.items()):
        try:
            os.makedirs(e, 0o755, exist_ok=True)
            move_mount(fd, e)
        except OSError as exc:
            prot["warnings"].append(f"cannot re-expose {e}: {exc}")
        finally:
            os.close(fd)
    prot["hidden"] = hidden
    try:
        mount_setattr("/", True, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
        for s in scratch:
            mount_setattr(s, False, 0, MOUNT_ATTR_RDONLY)
        prot["readonly_root"] = True
    except OSError:
        prot["readonly_root"] = _remount_readonly(set(scratch), prot)
    try:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        prot["private_proc"] = True
    except OSError as exc:
        prot["warnings"].append(f"cannot mount a private /proc: {exc}")


def _remount_readonly(skip: set[str], prot: dict) -> bool:
    """Fallback for kernels without mount_setattr: remount every mount read-only one by one."""
    ok = True
    flagmap = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    with open("/proc/self/mountinfo") as fh:
        lines = fh.read().splitlines()
    for line in lines:
        parts = line.split()
        target = parts[4].encode().decode("unicode_escape")
        if target in skip:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for opt in parts[5].split(","):
            flags |= flagmap.get(opt, 0)
        try:
            mount(None, target, None, flags)
        except OSError as exc:
            ok = False
            prot["warnings"].append(f"cannot make {target} read-only: {exc}")
    return ok


def _set_limits(cfg: dict, mode: str) -> dict:
    mb = 1 << 20
    lim = {
        "RLIMIT_AS": int(cfg["memory_mb"]) * mb,
        "RLIMIT_CPU": int(cfg["cpu_seconds"]),
        "RLIMIT_FSIZE": int(cfg["fsize"]),
        "RLIMIT_NOFILE": int(cfg["max_open_files"]),
        "RLIMIT_STACK": int(cfg["stack_mb"]) * mb,
        "RLIMIT_CORE": 0,
        "RLIMIT_MEMLOCK": 0,
        "RLIMIT_MSGQUEUE": 0,
    }
    nproc = int(cfg["max_processes"])
    if mode == "userns":
        nproc += 1  # H lives in the same user namespace
    lim["RLIMIT_NPROC"] = nproc
    applied = {}
    for name, value in lim.items():
        res = getattr(resource, name, None)
        if res is None:
            continue
        hard = value + 1 if name == "RLIMIT_CPU" else value
        try:
            resource.setrlimit(res, (value, hard))
            applied[name] = value
        except (OSError, ValueError):
            pass
    return applied


def child_main(cfg: dict) -> int:
    """Runs in C: finish isolation, then run the tests. Returns C's exit code."""
    mode = cfg["_mode"]
    cfg["_t"].append(time.time())
    prot: dict = {"mode": mode, "warnings": list(cfg.get("_ns_errors", ())), "pidns": mode != "none",
                  "netns": mode != "none", "hidden": [], "readonly_root": False, "private_tmp": False,
                  "private_proc": False, "uid": None, "caps": "?", "nproc_enforced": False}
    root = os.geteuid() == 0
    if mode != "none":
        try:
            _setup_mounts(cfg, mode, prot)
        except OSError as exc:
            prot["warnings"].append(f"mount setup failed: {exc}")
        work = "/tmp/work"
        os.mkdir(work, 0o700)
    else:
        work = cfg["_workdir"]
    uid = int(cfg["uid"])
    if root:
        try:
            os.chown(work, uid, uid)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            prot["uid"] = uid
        except OSError as exc:
            _send({"ev": "fatal", "msg": f"cannot drop root privileges: {exc}", "prot": prot})
            return 2
    elif mode == "userns":
        try:
            drop_capabilities()
        except OSError as exc:
            prot["warnings"].append(f"cannot drop namespace capabilities: {exc}")
        prot["uid"] = os.getuid()
    else:
        prot["uid"] = os.getuid()
    prot["nproc_enforced"] = root or mode == "userns"
    try:
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        prot["no_new_privs"] = True
    except OSError:
        prot["no_new_privs"] = False
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    prot["caps"] = _cap_eff()
    if prot["caps"] not in ("0000000000000000",):
        prot["warnings"].append(f"capabilities left: {prot['caps']}")
    stdlib = os.path.dirname(os.__file__)
    if not os.access(stdlib, os.R_OK | os.X_OK):
        prot["warnings"].append(f"standard library {stdlib} not readable: only preloaded modules import")
    if cfg.get("require") and (mode == "none" or prot["warnings"]):
        _send({"ev": "fatal", "msg": "required isolation unavailable: " + "; ".join(prot["warnings"] or ["no namespaces"]),
               "prot": prot})
        return 2
    cfg["_t"].append(time.time())
    os.chdir(work)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8", "TMPDIR": work})
    runner = _TestRunner(cfg, prot)
    prot["rlimits"] = _set_limits(cfg, mode)
    t = cfg["_t"]
    t.append(time.time())
    prot["setup_ms"] = {"unshare": round(1000 * (t[1] - t[0]), 2), "fork": round(1000 * (t[2] - t[1]), 2),
                        "isolate": round(1000 * (t[3] - t[2]), 2), "runner": round(1000 * (t[4] - t[3]), 2)}
    return runner.run()


class _Quitter:
    """``exit()`` / ``quit()`` as the site module defines them."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Use {self.name}() or Ctrl-D (i.e. EOF) to exit"

    def __call__(self, code: object = None) -> None:
        raise SystemExit(code)


class _TestTimeout(BaseException):
    """Raised by the per-test alarm inside candidate code."""


def _on_alarm(signum, frame):
    raise _TestTimeout()


class _TestRunner:
    """Runs the candidate's tests in this process and streams one event per step."""

    def __init__(self, cfg: dict, prot: dict) -> None:
        self.cfg = cfg
        self.prot = prot
        self.code = cfg["code"]
        self.tests = cfg["tests"]
        self.start = int(cfg["start"])
        self.timeout = float(cfg["test_timeout"])
        self.load_timeout = float(cfg["load_timeout"])
        self.cap = int(cfg["max_output_bytes"])
        self.in_fd = os.memfd_create("stdin", 0)
        self.out_fd = os.memfd_create("stdout", 0)
        self.err_fd = os.memfd_create("stderr", 0)
        self.pid1 = os.getpid() == 1
        sys.argv[:] = ["solution.py"]
        try:
            sys.set_int_max_str_digits(0)
        except AttributeError:  # pragma: no cover - Python < 3.11
            pass
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        for name in ("exit", "quit"):  # normally added by site, which -S skips
            if not hasattr(builtins, name):
                setattr(builtins, name, _Quitter(name))

    # -- io plumbing
    def _redirect(self, data: str) -> None:
        for fd in (self.in_fd, self.out_fd, self.err_fd):
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, 0)
        raw = data.encode("utf-8", "surrogateescape")
        view = memoryview(raw)
        while view:
            view = view[os.write(self.in_fd, view):]
        os.lseek(self.in_fd, 0, 0)
        os.dup2(self.in_fd, 0)
        os.dup2(self.out_fd, 1)
        os.dup2(self.err_fd, 2)
        # long-lived per-test streams over the redirected descriptors (never closed: closefd=False)
        sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)  # noqa: SIM115

    def _collect(self) -> tuple[str, bool, str]:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001, S110 - candidate stream objects can raise anything
                pass
        size = os.fstat(self.out_fd).st_size
        data = os.pread(self.out_fd, self.cap + 1, 0)
        err = os.pread(self.err_fd, 2000, max(0, os.fstat(self.err_fd).st_size - 2000))
        return (data[: self.cap].decode("utf-8", "replace"), size > self.cap,
                err.decode("utf-8", "replace"))

    def _cleanup_processes(self) -> None:
        if self.pid1:  # kill everything else in our pid namespace (stray children, daemons)
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break

    def _namespace(self, name: str) -> dict:
        ns = {"__name__": name, "__builtins__": builtins}
        exec(self.cfg["prelude"], ns)  # noqa: S102 - running code is this module's purpose
        return ns

    # -- main loop
    def run(self) -> int:
        _send({"ev": "ready", "prot": self.prot})
        try:
            code_obj = compile(self.code, "solution.py", "exec")
        except BaseException as exc:  # noqa: BLE001 - SyntaxError, MemoryError, RecursionError...
            _send({"ev": "load_error", "msg": _describe(exc)})
            return 0
        kinds = {t["kind"] for t in self.tests}
        module_ns = None
        if kinds - {"stdio"}:
            self._redirect("")
            module_ns = self._namespace("__solution__")
            signal.setitimer(signal.ITIMER_REAL, self.load_timeout)
            try:
                exec(code_obj, module_ns)  # noqa: S102
                err = None
            except _TestTimeout:
                err = "timeout while executing the module"
            except BaseException as exc:  # noqa: BLE001
                err = _describe(exc)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if err is not None:
                _send({"ev": "load_error", "msg": err})
                return 0
            self._cleanup_processes()
            _send({"ev": "loaded"})
        for offset, test in enumerate(self.tests):
            i = self.start + offset
            _send({"ev": "begin", "i": i})
            try:
                if test["kind"] == "stdio":
                    msg = self._run_stdio(code_obj, test)
                else:
                    msg = self._run_value(module_ns, test)
            except _TestTimeout:  # the alarm fired between the candidate's return and its cancellation
                signal.setitimer(signal.ITIMER_REAL, 0)
                msg = {"st": "timeout", "t": self.timeout, "err": ""}
            self._cleanup_processes()
            msg["ev"] = "end"
            msg["i"] = i
            _send(msg)
        _send({"ev": "done"})
        return 0

    def _run_stdio(self, code_obj, test: dict) -> dict:
        self._redirect(test.get("input", ""))
        ns = self._namespace("__main__")
        status, err = "ok", ""
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        t0 = _perf()
        try:
            try:
                exec(code_obj, ns)  # noqa: S102
            except SystemExit:
                pass
            try:
                atexit._run_exitfuncs()
                atexit._clear()
            except SystemExit:
                pass
        except _TestTimeout:
            status = "timeout"
        except BaseException as exc:  # noqa: BLE001
            status, err = "error", _describe(exc)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        elapsed = _perf() - t0
        ns.clear()
        out, truncated, stderr = self._collect()
        if truncated and status == "ok":
            status, err = "error", f"output limit exceeded ({self.cap} bytes)"
        return {"st": status, "t": elapsed, "out": out, "err": err or stderr[-500:]}

    def _run_value(self, module_ns: dict, test: dict) -> dict:
        self._redirect("")
        status, err, value = "ok", "", None
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        t0 = _perf()
        try:
            if test["kind"] == "call":
                fn = _resolve(module_ns, test["fn"])
                args = decode_value(test["args"])
                result = fn(*args)
            else:
                result = eval(compile(test["expr"], "<test>", "eval"), module_ns)
            elapsed = _perf() - t0
            value = encode_value(result)
        except _TestTimeout:
            status = "timeout"
        except BaseException as exc:  # noqa: BLE001 - includes SystemExit from the candidate
            status, err = "error", _describe(exc)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if status != "ok":
            elapsed = _perf() - t0
        self._collect()
        msg = {"st": status, "t": elapsed, "err": err}
        if status == "ok":
            msg["val"] = value
        return msg


def _resolve(ns: dict, name: str):
    """The callable for ``name``: a module-level function, or a method of a fresh ``Solution()``
    (LeetCode / LiveCodeBench functional problems)."""
    fn = ns.get(name)
    if callable(fn) and not isinstance(fn, type):
        return fn
    sol = ns.get("Solution")
    if isinstance(sol, type) and hasattr(sol, name):
        return getattr(sol(), name)
    if callable(fn):
        return fn
    raise NameError(f"entry point {name!r} is not defined")


def _describe(exc: BaseException) -> str:
    try:
        text = f"{type(exc).__name__}: {exc}"
    except BaseException:  # noqa: BLE001 - a candidate exception whose __str__ raises
        text = type(exc).__name__
    return text[:500]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "zygote":
        zygote_main(int(sys.argv[2]))
    else:
        sys.stderr.write("usage: _harness.py zygote SOCKET_FD\n")
        sys.exit(2)
