"""Sandbox harness: the fork server ("zygote"), the isolation steps and the in-sandbox runners.

This file runs as a script in a separate interpreter (``python -I -S -B _harness.py zygote FD``)
and must stay standard-library only and self-contained: isolated mode puts neither this folder
nor site-packages on ``sys.path`` (so it is one file). The parent side (:mod:`vpo.sandbox`)
imports it only for the value codec and a few helpers.

Process tree for one sandbox process::

    zygote Z (long-lived, child subreaper; never holds candidate data; sits in its slot's
      │       cgroup leaf, exempt from the OOM killer, so every sandbox it forks is born there)
      └─ C   pid 1 of a new pid namespace: reads its payload, unshares mount/ipc/uts(/net),
             minimal root, the slot's unprivileged uid, fresh session keyring, rlimits, seccomp
             filter; then serves requests from the parent

As root, Z forks C directly into a new pid namespace (unshare(CLONE_NEWPID) for its next child,
then setns back to its own). Otherwise an intermediate process H is forked, which creates the
namespaces (a user namespace included) and forks C as pid 1.

Z receives only a fixed-size header and three descriptors per sandbox (event pipe, payload
memfd, command pipe); the payload (program, tests' settings) is read after the fork, so no
candidate's data is ever in the memory a later sandbox is forked from. C answers one request at
a time from its command pipe and writes one JSON line per event to its event pipe; the parent
judges outputs itself, so nothing C says can turn a wrong answer into a pass, and expected
outputs never enter the sandbox. A protection C cannot set up is reported in a ``fatal`` event
and the candidate is not run, unless the parent's configuration accepts going without it.

Each test has two alarms: the process's CPU time (``ITIMER_PROF``, all threads) and a wall-clock
ceiling that does not count time spent waiting for a CPU; the parent enforces both again from
outside (the cgroup's CPU time covers child processes too).

C runs in one of two roles: ``candidate`` (the program under test: loads it, then runs the
call / stdio requests, and ``get`` for the plain values an expression test reads) or ``judge``
(a dataset's own test code, e.g. a HumanEval ``check``, run step by step, and ``expr`` tests:
every call of the candidate is a message to the parent, which forwards it to the candidate's
sandbox and returns the plain value, so the candidate never sees the judge's code, frames or
expected values, and the judge computes only on plain data).
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import fcntl
import gc
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

MAX_DEPTH = 100
MAX_SAME_HASH = 64  # elements of one set / keys of one dict that may share a hash value
BIG_INT_BITS = 12_000  # ints above this size travel as hex ({"$x": ...}): linear to parse


class CodecError(ValueError):
    """A value cannot be sent across the sandbox boundary (unsupported type, too deep, or a
    set/dict whose elements collide in their hash values)."""


def encode_value(x: object, depth: int = 0) -> object:
    """Encode a plain Python value as JSON-compatible data, preserving tuples, sets, non-string
    dict keys, bytes, complex, big ints and non-finite floats through tags. Subclasses of
    builtin types are rebuilt as their exact base type first, so the judge (in another process)
    only ever sees plain data and a candidate's ``__eq__`` or ``__repr__`` never takes part in
    the verdict; any other object is rejected."""
    if depth > MAX_DEPTH:
        raise CodecError("value nested too deeply")
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        if int.bit_length(x) > BIG_INT_BITS:
            return {"$x": int.__format__(x, "x")}
        return x
    if t is float:
        if math.isfinite(x):
            return x
        return {"$f": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
    d = depth + 1
    if t is list:
        return [encode_value(v, d) for v in list.copy(x)]
    if t is tuple:
        return {"$t": [encode_value(v, d) for v in x]}
    if t is dict:
        return {"$d": [[encode_value(k, d), encode_value(v, d)] for k, v in dict.items(dict.copy(x))]}
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
    ordinary dicts). Bounded: nesting depth, and sets/dicts whose elements share a hash value
    more than ``MAX_SAME_HASH`` times (which would make building them quadratic) are refused."""
    if depth > MAX_DEPTH:
        raise CodecError("value nested too deeply")
    t = type(x)
    if x is None or t is bool or t is str or t is int or t is float:
        return x
    d = depth + 1
    if t is list:
        return [decode_value(v, d) for v in x]
    if t is not dict:
        return x  # not JSON data (a caller's own Python value): passed through
    if len(x) == 1:
        (tag, v), = x.items()
        if tag == "$t":
            return tuple(decode_value(i, d) for i in _items(v))
        if tag == "$s":
            return set(_distinct([_hashable(decode_value(i, d)) for i in _items(v)]))
        if tag == "$fs":
            return frozenset(_distinct([_hashable(decode_value(i, d)) for i in _items(v)]))
        if tag == "$d":
            pairs = []
            for kv in _items(v):
                if type(kv) is not list or len(kv) != 2:
                    raise CodecError("a $d entry must be a [key, value] pair")
                pairs.append((_hashable(decode_value(kv[0], d)), decode_value(kv[1], d)))
            _distinct([k for k, _ in pairs])
            return dict(pairs)
        if tag == "$f":
            if v not in ("nan", "inf", "-inf"):
                raise CodecError("bad $f value")
            return float(v)
        if tag == "$b":
            if type(v) is not str:
                raise CodecError("bad $b value")
            return v.encode("latin-1")
        if tag == "$c":
            parts = [decode_value(p, d) for p in _items(v)]
            if len(parts) != 2 or any(type(p) not in (int, float) for p in parts):
                raise CodecError("bad $c value")
            return complex(parts[0], parts[1])
        if tag == "$x":
            if type(v) is not str or not v or len(v) > 1 << 24:
                raise CodecError("bad $x value")
            return int(v, 16)
    _distinct(list(x))
    return {k: decode_value(v, d) for k, v in x.items()}


def _items(v: object) -> list:
    if type(v) is not list:
        raise CodecError("a tagged container must hold a list")
    return v


def _hashable(v: object) -> object:
    if type(v) is list:
        return tuple(_hashable(i) for i in v)
    if type(v) is set:
        return frozenset(v)
    if type(v) is dict:
        raise CodecError("a dict cannot be a set element or dict key")
    return v


def _distinct(keys: list) -> list:
    """Refuse a collection whose keys share one hash value too often (a crafted hash-collision
    set makes every insertion scan all earlier keys: quadratic time)."""
    if len(keys) > MAX_SAME_HASH:
        counts: dict[int, int] = {}
        for k in keys:
            h = hash(k)
            c = counts.get(h, 0) + 1
            if c > MAX_SAME_HASH:
                raise CodecError(f"more than {MAX_SAME_HASH} elements share one hash value")
            counts[h] = c
    return keys


# ----------------------------------------------------------------------------------------------
# Linux primitives (ctypes; Python 3.11 has no os.unshare / mount wrappers)

CLONE_NEWTIME = 0x00000080
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEW_ANY = CLONE_NEWTIME | CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER \
    | CLONE_NEWPID | CLONE_NEWNET
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
OPEN_TREE_CLONE, AT_RECURSIVE, AT_FDCWD, MOVE_MOUNT_F_EMPTY_PATH = 1, 0x8000, -100, 0x4
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 0x1, 0x2, 0x4, 0x8
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 22, 38, 36
KEYCTL_JOIN_SESSION_KEYRING = 1
SECCOMP_MODE_FILTER = 2

# System call numbers that differ per architecture (the mount API and newer calls are shared).
_SYSCALLS = {
    "x86_64": {
        "ptrace": 101, "syslog": 103, "uselib": 134, "personality": 135, "vhangup": 153, "pivot_root": 155,
        "adjtimex": 159, "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166,
        "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171, "iopl": 172,
        "ioperm": 173, "init_module": 175, "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212,
        "clock_settime": 227, "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250,
        "unshare": 272, "perf_event_open": 298, "fanotify_init": 300, "name_to_handle_at": 303,
        "open_by_handle_at": 304, "clock_adjtime": 305, "setns": 308, "process_vm_readv": 310,
        "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "kexec_file_load": 320, "bpf": 321,
        "userfaultfd": 323, "clone": 56, "socket": 41, "socketpair": 53, "fcntl": 72, "flock": 73,
        "inotify_init": 253, "inotify_add_watch": 254, "inotify_init1": 294, "fanotify_mark": 301,
        "mincore": 27, "madvise": 28, "readahead": 187, "fadvise64": 221, "sync": 162, "syncfs": 306,
        "sync_file_range": 277, "preadv2": 327, "pwritev2": 328, "io_setup": 206, "io_submit": 209,
    },
    "aarch64": {
        "ptrace": 117, "syslog": 116, "personality": 92, "vhangup": 58, "pivot_root": 41, "adjtimex": 171,
        "chroot": 51, "acct": 89, "settimeofday": 170, "mount": 40, "umount2": 39, "swapon": 224,
        "swapoff": 225, "reboot": 142, "sethostname": 161, "setdomainname": 162, "init_module": 105,
        "delete_module": 106, "quotactl": 60, "lookup_dcookie": 18, "clock_settime": 112, "kexec_load": 104,
        "add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97, "perf_event_open": 241,
        "fanotify_init": 262, "name_to_handle_at": 264, "open_by_handle_at": 265, "clock_adjtime": 266,
        "setns": 268, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "finit_module": 273,
        "kexec_file_load": 294, "bpf": 280, "userfaultfd": 282, "clone": 220, "socket": 198, "socketpair": 199,
        "fcntl": 25, "flock": 32, "inotify_init1": 26, "inotify_add_watch": 27, "fanotify_mark": 263,
        "mincore": 232, "madvise": 233, "readahead": 213, "fadvise64": 223, "sync": 81, "syncfs": 267,
        "sync_file_range": 84, "preadv2": 286, "pwritev2": 287, "io_setup": 0, "io_submit": 2,
    },
}
_COMMON_SYSCALLS = {
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "clone3": 435, "pidfd_getfd": 438,
    "process_madvise": 440, "mount_setattr": 442, "quotactl_fd": 443, "cachestat": 451, "open_tree_attr": 467,
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
MACHINE = os.uname().machine


def _nr(name: str) -> int | None:
    table = _SYSCALLS.get(MACHINE)
    if table is None:
        return None
    return table.get(name, _COMMON_SYSCALLS.get(name))


_libc = None


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.syscall.restype = ctypes.c_long
        lib.unshare.argtypes = [ctypes.c_int]
        lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.setns.argtypes = [ctypes.c_int, ctypes.c_int]
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


def umount2(target: str, flags: int) -> None:
    _check(_lib().umount2(_b(target), flags), f"umount {target}")


def _syscall(name: str, *args: object) -> int:
    nr = _nr(name)
    if nr is None:
        raise OSError(38, f"{name}: unknown system call number on {MACHINE}")
    conv = [a if isinstance(a, (bytes, ctypes.Array)) or a is None else ctypes.c_long(int(a)) for a in args]
    return _check(_lib().syscall(ctypes.c_long(nr), *conv), name)


def open_tree(path: str) -> int:
    return _syscall("open_tree", AT_FDCWD, _b(path), OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC)


def move_mount(fd: int, target: str) -> None:
    _syscall("move_mount", fd, b"", AT_FDCWD, _b(target), MOVE_MOUNT_F_EMPTY_PATH)


def mount_setattr(path: str, recursive: bool, attr_set: int, attr_clr: int) -> None:
    buf = ctypes.create_string_buffer(struct.pack("QQQQ", attr_set, attr_clr, 0, 0))
    _syscall("mount_setattr", AT_FDCWD, _b(path), AT_RECURSIVE if recursive else 0, buf, 32)


def pivot_root(new: str, old: str) -> None:
    _syscall("pivot_root", _b(new), _b(old))


def prctl(option: int, arg: int) -> None:
    _check(_lib().prctl(option, arg, 0, 0, 0), f"prctl {option}")


def set_name(name: str) -> None:
    """The process name shown by ps/top (PR_SET_NAME); best effort."""
    try:
        buf = ctypes.create_string_buffer(name.encode()[:15])
        _lib().prctl(15, ctypes.addressof(buf), 0, 0, 0)
    except Exception:  # noqa: BLE001, S110 - cosmetic
        pass


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
# seccomp: a BPF program built here, installed with prctl (no compiled dependency)

# syscalls a sandbox never needs: other processes' memory, the kernel keyring, mounts and new
# namespaces (all set up before the filter), BPF, perf, io_uring (bypasses the filter), modules,
# clocks, reboot, handles that escape the mount view...
SECCOMP_DENY = (
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp", "pidfd_getfd",
    "keyctl", "add_key", "request_key",
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "open_tree_attr", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "unshare", "setns",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff",
    "acct", "quotactl", "quotactl_fd", "syslog", "settimeofday", "clock_settime", "adjtimex", "clock_adjtime",
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "fanotify_init", "vhangup", "iopl", "ioperm",
    "uselib", "personality", "sethostname", "setdomainname",
    # shared-file channels: a lock or a watch on a file every sandbox sees (a read-only system file,
    # the standard library's __pycache__) would carry information from one sandbox to another
    "flock", "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_mark",
    # the page cache of those files: probing which pages are cached, or loading and evicting them
    # on purpose, would carry information too (see also the madvise and preadv2 rules below); Linux
    # AIO would bypass the preadv2 rule (RWF_NOWAIT in an iocb)
    "mincore", "cachestat", "readahead", "fadvise64", "io_setup", "io_submit",
    # host-wide writeback: forcing it slows every process of the host, a channel and a nuisance
    "sync", "syncfs", "sync_file_range",
)
# fcntl commands refused for the same reason: POSIX and open-file-description record locks (set and
# query), leases, directory notifications; every other fcntl (F_GETFL, F_DUPFD...) is allowed
FCNTL_DENY = (5, 6, 7, 36, 37, 38, 1024, 1025, 1026)  # F_GETLK F_SETLK F_SETLKW F_OFD_* F_SETLEASE F_GETLEASE F_NOTIFY
MADVISE_DENY = (3, 20, 21)  # MADV_WILLNEED (read-ahead of a file mapping), MADV_COLD, MADV_PAGEOUT (eviction)
RWF_NOWAIT = 0x8  # preadv2/pwritev2 flag: fails instead of waiting when the data is not cached (a cache probe)
AF_UNIX, AF_INET, AF_INET6, SOCK_STREAM = 1, 2, 10, 1
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET, _AND = 0x20, 0x15, 0x35, 0x45, 0x06, 0x54


def seccomp_program(machine: str = MACHINE) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions: other architectures' calling conventions
    (e.g. i386 ``int 0x80`` on x86_64) kill the process; the calls in ``SECCOMP_DENY`` fail
    with EPERM; ``clone`` with any namespace flag and ``clone3`` (its flags live in memory the
    filter cannot read; libc falls back to ``clone``) are refused; file locks, leases and
    notifications (``flock``, the lock/lease/notify ``fcntl`` commands of ``FCNTL_DENY``,
    inotify, fanotify) are refused; so are page-cache probes and controls (``mincore``,
    ``cachestat``, ``readahead``, ``fadvise64``, Linux AIO, ``madvise`` with an advice of
    ``MADVISE_DENY``, ``preadv2``/``pwritev2`` with ``RWF_NOWAIT``) and host-wide writeback
    (``sync``, ``syncfs``, ``sync_file_range``); sockets only for AF_INET and
    AF_INET6 (no Unix, netlink, vsock... sockets: no host socket can be reached by path or
    abstract name); ``socketpair`` only as connected AF_UNIX streams (a datagram pair could be
    re-connected to a host socket). Everything else is allowed."""
    table = _SYSCALLS.get(machine)
    if table is None:
        raise OSError(38, f"no seccomp filter for architecture {machine}")
    nr = {**_COMMON_SYSCALLS, **table}
    prog: list[list] = []  # [code, jt, jf, k], jt/jf may be label names until resolved
    labels: dict[str, int] = {}

    def emit(code: int, k: int = 0, jt: object = 0, jf: object = 0) -> None:
        prog.append([code, jt, jf, k])

    def label(name: str) -> None:
        labels[name] = len(prog)

    emit(_LD_W_ABS, 4)  # seccomp_data.arch
    emit(_JEQ, _AUDIT_ARCH[machine], jt=1)
    emit(_RET, _RET_KILL_PROCESS)
    emit(_LD_W_ABS, 0)  # seccomp_data.nr
    if machine == "x86_64":
        emit(_JGE, 0x40000000, jt="deny")  # the x32 ABI
    for name in SECCOMP_DENY:
        if name in nr:
            emit(_JEQ, nr[name], jt="deny")
    emit(_JEQ, nr["clone3"], jt="enosys")
    emit(_JEQ, nr["clone"], jt="clone")
    emit(_JEQ, nr["socket"], jt="socket")
    emit(_JEQ, nr["socketpair"], jt="socketpair")
    emit(_JEQ, nr["fcntl"], jt="fcntl")
    emit(_JEQ, nr["madvise"], jt="madvise")
    emit(_JEQ, nr["preadv2"], jt="rwflags")
    emit(_JEQ, nr["pwritev2"], jt="rwflags")
    emit(_RET, _RET_ALLOW)

    def deny_values(name: str, offset: int, values: tuple[int, ...]) -> None:
        label(name)
        emit(_LD_W_ABS, offset)
        for value in values:
            emit(_JEQ, value, jt="deny")
        emit(_RET, _RET_ALLOW)

    deny_values("madvise", 32, MADVISE_DENY)  # args[2]: the advice
    deny_values("fcntl", 24, FCNTL_DENY)  # args[1]: the command
    label("rwflags")
    emit(_LD_W_ABS, 56)  # args[5]: the RWF_* flags
    emit(_JSET, RWF_NOWAIT, jt="deny", jf="allow")
    label("clone")
    emit(_LD_W_ABS, 16)  # args[0] (low 32 bits): clone flags
    emit(_JSET, CLONE_NEW_ANY, jt="deny", jf="allow")
    label("socket")
    emit(_LD_W_ABS, 16)  # args[0]: domain
    emit(_JEQ, AF_INET, jt="allow")
    emit(_JEQ, AF_INET6, jt="allow", jf="noafs")
    label("socketpair")
    emit(_LD_W_ABS, 16)
    emit(_JEQ, AF_UNIX, jf="noafs")
    emit(_LD_W_ABS, 24)  # args[1]: type (flags in the high bits)
    emit(_AND, 0xF)
    emit(_JEQ, SOCK_STREAM, jt="allow", jf="noafs")
    label("allow")
    emit(_RET, _RET_ALLOW)
    label("deny")
    emit(_RET, _RET_ERRNO | _EPERM)
    label("enosys")
    emit(_RET, _RET_ERRNO | _ENOSYS)
    label("noafs")
    emit(_RET, _RET_ERRNO | _EAFNOSUPPORT)
    out = []
    for i, (code, jt, jf, k) in enumerate(prog):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        if not (0 <= jt < 256 and 0 <= jf < 256):
            raise ValueError("seccomp jump out of range")
        out.append((code, jt, jf, k))
    return out


_SECCOMP_BUILT: list = []  # (filter array, fprog): built once in the zygote, shared by every sandbox


def _seccomp_fprog() -> tuple[object, object]:
    if not _SECCOMP_BUILT:
        prog = seccomp_program()

        class SockFilter(ctypes.Structure):
            _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

        class SockFprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

        arr = (SockFilter * len(prog))(*[SockFilter(*ins) for ins in prog])
        _SECCOMP_BUILT[:] = [arr, SockFprog(len(prog), ctypes.cast(arr, ctypes.POINTER(SockFilter)))]
    return _SECCOMP_BUILT[0], _SECCOMP_BUILT[1]


def install_seccomp() -> int:
    """Install :func:`seccomp_program` for this process and its future children (needs
    no_new_privs or CAP_SYS_ADMIN). Returns the number of instructions."""
    _arr, fprog = _seccomp_fprog()
    _check(_lib().prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "seccomp")
    return fprog.len


# ----------------------------------------------------------------------------------------------
# zygote


HEADER = struct.Struct("<4sQ")
OP_RUN, OP_KILL = b"RUN ", b"KILL"
PRELOAD = (
    "typing", "collections", "heapq", "math", "itertools", "bisect", "functools", "string", "re",
    "random", "operator", "fractions", "decimal", "statistics", "array", "copy", "datetime", "json",
)
SYSTEM_VIEW = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
_WARM_PRELUDE = "from typing import *\nfrom collections import *\nfrom math import *\nfrom builtins import *\n"


def _under(p: str, q: str) -> bool:
    return p == q or p.startswith(q.rstrip("/") + "/")


def _top_level(paths: set[str]) -> list[str]:
    keep = sorted(paths)
    return [p for p in keep if not any(p != q and _under(p, q) for q in keep)]


def _interpreter_paths() -> dict:
    """What the interpreter needs after the filesystem view is narrowed (its prefixes and
    standard library), the further ``sys.path`` entries (site-packages, ``.pth`` additions such
    as editable installs), and its site-packages directories."""
    import sysconfig

    def real_dir(p: str) -> str | None:
        if not p:
            return None
        p = os.path.realpath(p)
        if os.path.isfile(p):
            p = os.path.dirname(p)
        return p if os.path.isdir(p) else None

    paths = sysconfig.get_paths()
    interp = {real_dir(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                    paths.get("stdlib"), paths.get("platstdlib"), os.path.dirname(os.__file__))}
    interp.discard(None)
    site_dirs = {real_dir(paths.get(k, "")) for k in ("purelib", "platlib")}
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}  # a virtualenv's interpreter's own
    site_dirs |= {real_dir(sysconfig.get_path(k, vars=base) or "") for k in ("purelib", "platlib")}
    try:
        from site import getsitepackages  # importable under -S; not executed at startup
        site_dirs |= {real_dir(p) for p in getsitepackages()}
    except Exception:  # noqa: BLE001, S110 - best effort
        pass
    site_dirs.discard(None)
    on_path = {real_dir(p) for p in sys.path} - {None}
    extra = {p for p in on_path if not any(_under(p, q) for q in interp)}
    used_sites = {p for p in site_dirs if p in on_path}
    return {"interp": _top_level(interp), "extra": sorted(extra), "site_dirs": sorted(site_dirs - used_sites),
            "site_on_path": sorted(used_sites)}


INTERP: dict = {}
SLOT: dict = {}  # this fork server's slot: the uid of its sandboxes and the cgroup leaf they join
WORKDIR = [""]  # the work directory of a sandbox without a mount namespace (made and removed by the zygote)


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


def _warm_up() -> None:
    """Exercise the compiler, the codec and JSON once with our own data, then freeze the heap:
    a forked sandbox then writes (and copies) far fewer of the zygote's pages."""
    ns = {"__name__": "__warm__", "__builtins__": builtins}
    code = compile(_WARM_PRELUDE + "def f(x):\n    return [x, (x, 1.5), {x: 'a'}, {x}, b'x', None, True]\n",
                   "<warm-up>", "exec")
    exec(code, ns)  # noqa: S102 - our own constant code
    wire = json.dumps({"ev": "end", "i": 0, "st": "ok", "val": encode_value(ns["f"](3))})
    decode_value(json.loads(wire)["val"])
    if MACHINE in _SYSCALLS:
        _seccomp_fprog()
    gc.collect()
    gc.freeze()


def _direct_pid_namespaces() -> int | None:
    """As root: a descriptor of this process's pid namespace if it can give its next child a new
    pid namespace (unshare) and then return to its own (setns); None otherwise."""
    if os.geteuid() != 0:
        return None
    try:
        fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        unshare(CLONE_NEWPID)
        _check(_lib().setns(fd, CLONE_NEWPID), "setns")
        return fd
    except OSError:
        os.close(fd)
        return None


def _join_cgroup() -> dict:
    """Move this fork server into its slot's cgroup leaf, once: every sandbox it forks is born
    there (no per-sandbox migration, which costs the kernel milliseconds), and the fork server
    itself is exempt from the leaf's OOM killer. Returns the report: the leaf and its limits, or
    why there is none."""
    cg = SLOT.get("cgroup")
    if not cg:
        return {"version": None, "why": SLOT.get("cgroup_why") or "disabled by config"}
    try:
        for path in cg["procs"]:
            with open(path, "w") as fh:
                fh.write("0")
    except OSError as exc:
        return {"version": None, "why": f"cannot join {path}: {exc.strerror or exc}"}
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("-1000")
    except OSError:  # not root: the fork server may be chosen by the OOM killer; it is then replaced
        pass
    return {k: v for k, v in cg.items() if k != "procs"}


def zygote_main(sock_fd: int, namespaces: str = "auto", slot: dict | None = None) -> None:
    """Serve RUN requests forever: fork one sandbox per request, report its pid and exit status.
    A request carries no payload, only descriptors, so this process never holds candidate data.
    As root, the sandbox is forked directly as pid 1 of a new pid namespace (this process then
    returns to its own); otherwise an intermediate process creates the namespaces."""
    sock = socket.socket(fileno=sock_fd)
    SLOT.update(slot or {})
    set_name("vpo-zygote")
    for name in PRELOAD:
        __import__(name)
    _lib()
    INTERP.update(_interpreter_paths())
    try:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        subreaper = True
    except OSError:
        subreaper = False
    # Every sandbox gets a network namespace of its own (made with its other namespaces): one
    # shared by a fork server's sandboxes would carry its counters (/proc/net/snmp...) from one
    # candidate to the next.
    own_pidns = _direct_pid_namespaces() if namespaces != "off" else None
    _warm_up()
    SLOT["joined"] = _join_cgroup()  # after the warm-up: the fork server's own heap stays charged where it was
    _send_line(sock, {"hello": 1, "pid": os.getpid(), "euid": os.geteuid(), "interp": INTERP,
                      "cgroup": SLOT["joined"],
                      "direct": own_pidns is not None,
                      "subreaper": subreaper, "python": sys.version.split()[0], "machine": MACHINE})
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
        op, _length = HEADER.unpack(data)
        if op != OP_RUN or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            continue  # a late KILL for a finished run, or junk
        direct = own_pidns is not None
        if not direct or namespaces == "off":  # a sandbox that may end up without a private /tmp
            import tempfile
            WORKDIR[0] = tempfile.mkdtemp(prefix="vpo-sbx-")
        try:
            if direct:
                unshare(CLONE_NEWPID)  # for the next child only
            pid = os.fork()
        except OSError as exc:
            pid = -1
            error = f"fork failed: {exc}"
        if pid == 0:
            code = 70
            try:
                code = direct_main(fds) if direct else sandbox_main(fds, zpid)
            finally:
                os._exit(code)
        if direct and _lib().setns(own_pidns, CLONE_NEWPID) != 0:  # back to our own for the next request
            os.abort()  # cannot happen (entering one's own pid namespace); never fork into a stale one
        if pid < 0:
            for fd in fds:
                os.close(fd)
            if WORKDIR[0]:
                os.rmdir(WORKDIR[0])
                WORKDIR[0] = ""
            _send_line(sock, {"error": error})
            continue
        for fd in fds:
            os.close(fd)
        _send_line(sock, {"pid": pid})
        status, gone = _wait_child(pid, sock)
        killed = _reap_orphans()
        if WORKDIR[0]:
            import shutil
            shutil.rmtree(WORKDIR[0], ignore_errors=True)
            WORKDIR[0] = ""
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
# H: payload, namespaces, then fork C as pid 1


def _close_fds_from(lowest: int) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd >= lowest:
            try:
                os.close(fd)
            except OSError:
                pass


def _read_payload(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks, off = [], 0
    while off < size:
        b = os.pread(fd, min(size - off, 1 << 22), off)
        if not b:
            break
        chunks.append(b)
        off += len(b)
    return b"".join(chunks)


def _take_payload(fds: list[int]) -> dict:
    """Read the payload from its memfd; the event pipe becomes fd 3, the command pipe fd 4,
    stdio /dev/null, every other descriptor is closed."""
    ev_fd, payload_fd, cmd_fd = fds
    payload = _read_payload(payload_fd)
    ev_hi = fcntl.fcntl(ev_fd, fcntl.F_DUPFD, 10)
    cmd_hi = fcntl.fcntl(cmd_fd, fcntl.F_DUPFD, 10)
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.dup2(ev_hi, 3)
    os.dup2(cmd_hi, 4)
    _close_fds_from(5)
    return json.loads(payload)


def _oom_killable() -> None:
    """Undo the fork server's exemption from the OOM killer for this sandbox process."""
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("0")
    except OSError:
        pass


def direct_main(fds: list[int]) -> int:
    """Runs in C forked by the zygote (as root) as pid 1 of a new pid namespace: the remaining
    namespaces, then :func:`child_main`. Returns C's exit code."""
    t_fork = time.time()
    os.setsid()
    _oom_killable()
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    cfg = _take_payload(fds)
    flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET
    errors = []
    try:
        unshare(flags)
        mode = "root"
    except OSError as exc:  # pragma: no cover - root without mount namespaces
        errors.append(str(exc))
        mode = "none"
    t = time.time()
    cfg.update({"_mode": mode, "_ns_errors": errors, "_t": [t_fork, t], "_workdir": WORKDIR[0]})
    return child_main(cfg)


def sandbox_main(fds: list[int], zpid: int) -> int:
    """Runs in H (forked from the zygote). ``fds``: event pipe (write end), payload memfd,
    command pipe (read end). Returns H's exit code."""
    t_fork = time.time()
    set_name("vpo-sbx-init")
    os.setsid()
    _oom_killable()
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != zpid:
        return 71
    cfg = _take_payload(fds)
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
    cfg["_workdir"] = WORKDIR[0]
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
    os.close(4)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 74


# ----------------------------------------------------------------------------------------------
# C: filesystem view, credentials, limits, then the runner

_os_write = os.write
_os_read = os.read
_os_exit = os._exit
_json_dumps = json.dumps
_json_loads = json.loads
_perf = time.perf_counter
_cpu = time.process_time


def _send(obj: dict, raw: str = "") -> None:
    """One event line; ``raw`` is further JSON members written as they are (already encoded)."""
    text = _json_dumps(obj, ensure_ascii=True)
    if raw:
        text = text[:-1] + ", " + raw + "}"
    data = text.encode() + b"\n"
    view = memoryview(data)
    while view:
        n = _os_write(3, view)
        view = view[n:]


def structure_count(wire: str | bytes) -> int:
    """An upper bound on the number of JSON values in a message, as the parent counts it
    before parsing (each value but the first of a container follows a comma)."""
    if isinstance(wire, str):
        return wire.count("[") + wire.count("{") + wire.count(",")
    return wire.count(b"[") + wire.count(b"{") + wire.count(b",")


def _plain_string(text: str) -> str:
    """A JSON string whose brackets and commas are escaped, so a program's output never counts
    as structure (:func:`structure_count`)."""
    return _json_dumps(text, ensure_ascii=True).replace(",", "\\u002c").replace("[", "\\u005b").replace("{", "\\u007b")


_CEILING = [0.0, 0.0, 0.0]  # when the alarms were armed, the run delay then, the wall-clock ceiling


def run_delay(path: str = "/proc/self/schedstat") -> float | None:
    """Seconds the process's main thread spent runnable but waiting for a CPU (schedstat)."""
    try:
        with open(path, "rb") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _arm(cpu: float, wall: float) -> None:
    """The per-test alarms: CPU time of this process (all its threads), and the wall-clock
    ceiling, which does not count time spent waiting for a CPU (a busy machine's doing)."""
    _CEILING[:] = [_perf(), run_delay() or 0.0, wall]
    signal.setitimer(signal.ITIMER_PROF, max(cpu, 0.001))
    signal.setitimer(signal.ITIMER_REAL, max(wall, 0.001))


def _disarm() -> None:
    signal.setitimer(signal.ITIMER_PROF, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)


class _Commands:
    """Newline-delimited JSON requests from the parent on fd 4 (blocking reads)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def read(self) -> dict | None:
        while True:
            nl = self.buf.find(b"\n")
            if nl >= 0:
                line = bytes(self.buf[:nl])
                del self.buf[: nl + 1]
                return _json_loads(line)
            data = _os_read(4, 1 << 20)
            if not data:
                return None
            self.buf += data


def _plan_view(cfg: dict, prot: dict) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Decide the minimal filesystem view: (directories exposed read-only at their own paths,
    paths to cover inside them, symlinks to recreate). Raises ValueError naming a required
    hidden path that the view cannot hide."""
    required = list(cfg.get("hide_required", ()))
    hidden_all = required + list(cfg.get("hide", ()))
    links: list[tuple[str, str]] = []
    exposed: set[str] = set()
    for p in SYSTEM_VIEW:
        if os.path.islink(p):
            links.append((p, os.readlink(p)))
        elif os.path.isdir(p):
            exposed.add(p)
    exposed.update(INTERP.get("interp", ()))
    if cfg.get("site_packages"):
        exposed.update(INTERP.get("site_on_path", ()))
        # further sys.path entries come from .pth files (editable installs: source checkouts,
        # which hold datasets): never part of the view
        prot["not_exposed"] = list(INTERP.get("extra", ()))
    exposed_list = _top_level(exposed)
    for h in required:
        for e in exposed_list:
            if _under(e, h):
                raise ValueError(f"cannot hide {h}: the sandbox's interpreter needs {e} inside it")
    covers = []
    hide = list(hidden_all)
    # installed packages may hold datasets: not part of the view, but those the interpreter imports
    # from with site_packages (a virtualenv's base interpreter's, inside its standard library, never)
    sites = list(INTERP.get("site_dirs", ())) + ([] if cfg.get("site_packages") else list(INTERP.get("site_on_path", ())))
    hide += sites
    prot["_site_dirs"] = sites
    for h in hide:
        if any(_under(h, e) for e in exposed_list) and not any(_under(e, h) for e in exposed_list):
            covers.append(h)
    prot["exposed"] = exposed_list
    return exposed_list, sorted(set(covers)), links


def _setup_root(cfg: dict, prot: dict, missing: list) -> None:
    """A fresh root: an empty tmpfs holding only the system directories and the interpreter
    (read-only binds at their own paths), with the dataset paths inside them covered; fresh
    size-limited tmpfs on /tmp and /dev/shm; a /dev with null, zero, full, random, urandom only;
    a /proc of the new pid namespace; everything read-only, nosuid and nodev (but the five
    devices); then pivot_root into it. Nothing outside the list exists in the sandbox.

    Every tree to expose is opened before anything is mounted, so the staging mount (on /tmp)
    hides nothing still needed; the sandbox's own /tmp, /dev and /proc are made before the binds,
    so an exposed directory inside /tmp (a virtualenv or checkout there) lands inside the private
    /tmp instead of colliding with it. Any step that fails is a missing protection (``view``);
    a required hidden path that the view cannot hide raises ValueError (a configuration error)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    exposed, covers, links = _plan_view(cfg, prot)
    for e in exposed:
        for own in ("/dev", "/proc"):
            if _under(e, own):
                raise ValueError(f"cannot expose {e} to the sandbox: {own} is the sandbox's own")
        if _under("/tmp", e):
            raise ValueError(f"cannot expose {e} to the sandbox: it contains /tmp, which is the sandbox's own")
    new = "/tmp"  # staging mount point; every tree to expose is already open
    grafts: dict[str, int] = {}
    devs: dict[str, int] = {}
    try:
        for e in exposed:
            grafts[e] = open_tree(e)
        for d in DEVICES:
            devs[d] = open_tree("/dev/" + d)
        mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
        for path, target in links:
            os.symlink(target, new + path)
        size = int(cfg["tmp_mb"])
        os.mkdir(new + "/tmp")
        mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={size}m,nr_inodes=4096,mode=1777")
        os.mkdir(new + "/dev", 0o755)
        mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
        for d, fd in devs.items():
            with open(new + "/dev/" + d, "w"):
                pass
            move_mount(fd, new + "/dev/" + d)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                             ("stderr", "/proc/self/fd/2")):
            os.symlink(target, new + "/dev/" + name)
        os.mkdir(new + "/dev/shm")
        mount("tmpfs", new + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={size}m,nr_inodes=4096,mode=1777")
        prot["private_tmp"] = True
        os.mkdir(new + "/proc")
        mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        prot["private_proc"] = True
        for e, fd in grafts.items():
            os.makedirs(new + e, 0o755, exist_ok=True)
            move_mount(fd, new + e)
        empty = new + "/.vpo-empty"
        with open(empty, "w"):
            pass
        for h in covers:
            target = new + h
            if os.path.isdir(target) and not os.path.islink(target):
                mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=16,mode=755")
            elif os.path.lexists(target):
                mount(empty, target, None, MS_BIND)
        os.mkdir(new + "/.old")
        try:
            mount_setattr(new, True, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0)
            for s in ("/tmp", "/dev/shm"):
                mount_setattr(new + s, False, 0, MOUNT_ATTR_RDONLY)
            for d in devs:
                mount_setattr(new + "/dev/" + d, False, 0, MOUNT_ATTR_NODEV)
            prot["readonly_root"] = prot["nodev"] = True
        except OSError:
            prot["readonly_root"] = prot["nodev"] = _remount_readonly(new, {new + "/tmp", new + "/dev/shm"},
                                                                       {new + "/dev/" + d for d in devs}, missing)
        pivot_root(new, new + "/.old")
        os.chdir("/")
        try:
            umount2("/.old", MNT_DETACH)
        except OSError:  # a locked mount tree (user namespace): cover it instead
            mount("tmpfs", "/.old", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,nr_inodes=16,mode=0")
        prot["view"] = "minimal"
    except OSError as exc:
        missing.append({"what": "view", "why": f"filesystem setup failed: {exc}"})
    finally:
        for fd in list(grafts.values()) + list(devs.values()):
            try:
                os.close(fd)
            except OSError:
                pass


def _remount_readonly(root: str, writable: set[str], devices: set[str], missing: list) -> bool:
    """Fallback for kernels without mount_setattr: remount every mount under ``root``
    read-only, nosuid and nodev one by one (``writable`` stay writable, ``devices`` keep dev)."""
    ok = True
    flagmap = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    with open("/proc/self/mountinfo") as fh:
        lines = fh.read().splitlines()
    for line in lines:
        parts = line.split()
        target = parts[4].encode().decode("unicode_escape")
        if not _under(target, root):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID
        for opt in parts[5].split(","):
            flags |= flagmap.get(opt, 0)
        if target not in writable:
            flags |= MS_RDONLY
        if target not in devices:
            flags |= MS_NODEV
        try:
            mount(None, target, None, flags)
        except OSError as exc:
            ok = False
            missing.append({"what": "view", "why": f"cannot make {target} read-only: {exc}"})
    return ok


def _is_hidden(path: str) -> bool:
    """Whether ``path`` shows nothing here: absent, an empty directory, or an empty file."""
    try:
        if not os.path.lexists(path):
            return True
        if os.path.isdir(path):
            return not os.listdir(path)
        return os.path.getsize(path) == 0
    except OSError:
        return True  # unreadable counts as hidden (nothing can be learned from it)


def _set_limits(cfg: dict, mode: str, missing: list) -> dict:
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
        except (OSError, ValueError) as exc:
            missing.append({"what": "limits", "why": f"cannot set {name}: {exc}"})
    return applied


def child_main(cfg: dict) -> int:
    """Runs in C: finish isolation, then serve the parent's requests. Returns C's exit code.

    Every protection that cannot be set up is recorded in ``missing`` (what, why); unless the
    configuration named it as accepted (``allow``), the candidate is not run: a ``fatal`` event
    lists what is missing and the process exits."""
    mode = cfg["_mode"]
    cfg["_t"].append(time.time())
    set_name("vpo-judge" if cfg.get("role") == "judge" else "vpo-sandbox")
    missing: list = []
    prot: dict = {"mode": mode, "role": cfg.get("role", "candidate"), "warnings": [],
                  "pidns": mode != "none", "netns": mode != "none", "netns_scope": "sandbox" if mode != "none" else None,
                  "view": "host", "exposed": [], "not_exposed": [],
                  "hidden": [], "readonly_root": False, "nodev": False, "private_tmp": False, "private_proc": False,
                  "uid": None, "caps": "?", "nproc_enforced": False, "keyring": None, "seccomp": False,
                  "cgroup": dict(SLOT.get("joined") or {"version": None}), "time": "cpu",
                  "shared_file_channels": "open", "page_cache": "open", "missing": missing}
    # everything not in force is listed; what the configuration accepts by name is filtered below
    if not prot["cgroup"].get("version"):
        missing.append({"what": "cgroup", "why": prot["cgroup"].get("why") or "not joined"})
    if mode == "none":
        why = "; ".join(cfg.get("_ns_errors", ())) or ("disabled by config" if cfg.get("namespaces") == "off" else "unavailable")
        missing.append({"what": "namespaces", "why": why})
    root = os.geteuid() == 0
    if mode != "none":
        try:
            _setup_root(cfg, prot, missing)
        except ValueError as exc:  # a required path cannot be hidden: a configuration error
            _send({"ev": "fatal", "msg": str(exc), "prot": prot, "config": True})
            return 2
        work = "/tmp/work"
        k = 0
        while os.path.lexists(work):  # an exposed directory inside /tmp may hold that name
            k += 1
            work = f"/tmp/work{k}"
        os.mkdir(work, 0o700)
    else:
        work = cfg.get("_workdir") or ""
        prot["warnings"].append("no private filesystem view: nothing is hidden")
        if not work:
            _send({"ev": "fatal", "msg": "no work directory for a sandbox without namespaces", "prot": prot})
            return 2
    uid = int(SLOT.get("uid") or 0)
    if root:
        try:
            if not uid:
                raise OSError(22, "no sandbox user id leased for this fork server")
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
            missing.append({"what": "credentials", "why": f"cannot drop namespace capabilities: {exc}"})
        prot["uid"] = os.getuid()
    else:
        prot["uid"] = os.getuid()
    prot["nproc_enforced"] = root or mode == "userns" or bool(prot["cgroup"].get("version"))
    nr_keyctl = _nr("keyctl")
    try:
        if nr_keyctl is None:
            raise OSError(38, "unknown architecture")
        _check(_lib().syscall(ctypes.c_long(nr_keyctl), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None), "keyctl")
        prot["keyring"] = "fresh"
    except OSError as exc:
        if exc.errno == 38:  # ENOSYS: no keyring support in the kernel, nothing to inherit
            prot["keyring"] = "none in kernel"
        else:
            missing.append({"what": "keyring", "why": f"cannot join a fresh session keyring: {exc}"})
    try:
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        prot["no_new_privs"] = True
    except OSError as exc:
        prot["no_new_privs"] = False
        missing.append({"what": "credentials", "why": f"cannot set no_new_privs: {exc}"})
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    prot["caps"] = _cap_eff()
    if prot["caps"] != "0000000000000000":
        missing.append({"what": "credentials", "why": f"capabilities left: {prot['caps']}"})
    # what is hidden is checked from inside, as the sandbox's own user
    required = cfg.get("hide_required", ())
    unhidden = [p for p in required if (os.path.lexists(p) if mode == "none" else not _is_hidden(p))]
    if unhidden:
        why = "no private filesystem view (namespaces unavailable)" if mode == "none" else "still readable"
        _send({"ev": "fatal", "msg": f"cannot hide {unhidden[0]}: {why}", "prot": prot, "config": True})
        return 2
    listed = list(cfg.get("hide_required", ())) + list(cfg.get("hide", ())) + prot.pop("_site_dirs", [])
    prot["hidden"] = sorted({p for p in listed if _is_hidden(p)})
    if mode != "none":  # a default path to hide that is still readable: the view is not what was promised
        for p in cfg.get("hide", ()):
            if p in prot["hidden"] or any(_under(e, p) for e in prot["exposed"]):
                continue
            if not _is_hidden(p):
                missing.append({"what": "view", "why": f"cannot hide {p}"})
    stdlib = os.path.dirname(os.__file__)
    if not os.access(stdlib, os.R_OK | os.X_OK):
        prot["warnings"].append(f"standard library {stdlib} not readable: only preloaded modules import")
    cfg["_t"].append(time.time())
    os.chdir(work)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8", "TMPDIR": work})
    runner = _JudgeRunner(cfg, prot) if cfg.get("role") == "judge" else _CandidateRunner(cfg, prot)
    prot["rlimits"] = _set_limits(cfg, mode, missing)
    if cfg.get("seccomp", True):
        try:
            prot["seccomp_instructions"] = install_seccomp()
            prot["seccomp"] = True
            prot["shared_file_channels"] = "filtered: flock, fcntl locks, leases and notifications, inotify, fanotify"
            prot["page_cache"] = ("probes and controls refused: mincore, cachestat, readahead, fadvise, AIO, madvise "
                                  "WILLNEED/COLD/PAGEOUT, preadv2/pwritev2 RWF_NOWAIT; sync, syncfs, sync_file_range "
                                  "refused; pages read are still shared with the host (timing)")
        except OSError as exc:
            missing.append({"what": "seccomp", "why": f"no seccomp filter: {exc}"})
    else:
        missing.append({"what": "seccomp", "why": "disabled by config"})
    allow = set(cfg.get("allow", ()))
    refused = [m for m in missing if m["what"] not in allow]
    if refused:
        _send({"ev": "fatal", "msg": "required isolation unavailable", "missing": refused, "prot": prot})
        return 2
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


def _on_ceiling(signum, frame):
    start, delay0, wall = _CEILING
    delay = run_delay()
    used = _perf() - start - (delay - delay0 if delay is not None else 0.0)
    if wall and used < wall:  # part of the time went to waiting for a CPU: not the candidate's
        signal.setitimer(signal.ITIMER_REAL, max(wall - used, 0.005))
        return
    raise _TestTimeout()


def _common_process_setup() -> None:
    sys.argv[:] = ["solution.py"]
    try:
        sys.set_int_max_str_digits(0)
    except AttributeError:  # pragma: no cover - Python < 3.11
        pass
    signal.signal(signal.SIGALRM, _on_ceiling)
    signal.signal(signal.SIGPROF, _on_alarm)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    for name in ("exit", "quit"):  # normally added by site, which -S skips
        if not hasattr(builtins, name):
            setattr(builtins, name, _Quitter(name))


class _CandidateRunner:
    """Loads the candidate's program, then runs one test per request and reports each."""

    def __init__(self, cfg: dict, prot: dict) -> None:
        self.cfg = cfg
        self.prot = prot
        self.code = cfg["code"]
        self.prelude = cfg.get("prelude") or ""
        self.needs_module = bool(cfg.get("needs_module"))
        self.timeout = float(cfg["test_timeout"])
        self.load_timeout = float(cfg["load_timeout"])
        self.cap = int(cfg["max_output_bytes"])
        self.max_items = int(cfg["max_value_items"])
        self.wall_factor = float(cfg["wall_factor"])
        self.in_fd = os.memfd_create("stdin", 0)
        self.out_fd = os.memfd_create("stdout", 0)
        self.err_fd = os.memfd_create("stderr", 0)
        self.pid1 = os.getpid() == 1
        self.commands = _Commands()
        _common_process_setup()

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
        if self.prelude:
            exec(self.prelude, ns)  # noqa: S102 - running code is this module's purpose
        return ns

    # -- main loop
    def run(self) -> int:
        _send({"ev": "ready", "prot": self.prot})
        try:
            code_obj = compile(self.code, "solution.py", "exec")
        except BaseException as exc:  # noqa: BLE001 - SyntaxError, MemoryError, RecursionError...
            _send({"ev": "load_error", "msg": _describe(exc)})
            return 0
        module_ns = None
        if self.needs_module:
            self._redirect("")
            _arm(self.load_timeout, self.load_timeout * self.wall_factor)
            try:
                module_ns = self._namespace("__solution__")
                exec(code_obj, module_ns)  # noqa: S102
                err = None
            except _TestTimeout:
                err = "timeout while executing the module"
            except BaseException as exc:  # noqa: BLE001
                err = _describe(exc)
            finally:
                _disarm()
            if err is not None:
                _send({"ev": "load_error", "msg": err})
                return 0
            self._cleanup_processes()
        _send({"ev": "loaded"})
        while True:
            req = self.commands.read()
            if req is None:
                _os_exit(0)  # the parent is done with us (no atexit, no thread joins)
            cpu = float(req.get("timeout", self.timeout))
            wall = float(req.get("wall", cpu * self.wall_factor))
            raw = ""
            try:
                if req["kind"] == "stdio":
                    msg, raw = self._run_stdio(code_obj, req, cpu, wall)
                else:
                    msg, raw = self._run_value(module_ns, req, cpu, wall)
            except _TestTimeout:  # an alarm fired between the candidate's return and its cancellation
                _disarm()
                msg, raw = {"st": "timeout", "t": cpu, "err": ""}, ""
            self._cleanup_processes()
            _send({"ev": "end", "i": req.get("i"), **msg}, raw)

    def _run_stdio(self, code_obj, req: dict, cpu: float, wall: float) -> tuple[dict, str]:
        self._redirect(req.get("input", ""))
        status, err, etype = "ok", "", ""
        _arm(cpu, wall)
        t0 = _perf()
        ns = None
        try:
            ns = self._namespace("__main__")
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
            status, err, etype = "error", _describe(exc), type(exc).__name__
        finally:
            _disarm()
        elapsed = _perf() - t0
        if ns is not None:
            ns.clear()
        out, truncated, stderr = self._collect()
        if truncated and status == "ok":
            status, err = "error", f"output limit exceeded ({self.cap} bytes)"
        msg = {"st": status, "t": elapsed, "err": err or stderr[-500:], "etype": etype}
        return msg, '"out": ' + _plain_string(out)

    def _run_value(self, module_ns: dict, req: dict, cpu: float, wall: float) -> tuple[dict, str]:
        self._redirect("")
        status, err, etype, wire, after = "ok", "", "", "", ""
        _arm(cpu, wall)
        t0 = _perf()
        elapsed = 0.0
        try:
            if req["kind"] == "call":
                fn = _resolve(module_ns, req["fn"])
                args = decode_value(req.get("args", []))
                kw = decode_value(req["kw"]) if req.get("kw") else {}
                result = fn(*args, **kw)
                if req.get("sync"):  # the judge's arguments, as this call left them (in-place tasks)
                    after = _json_dumps(encode_value([args, kw]), ensure_ascii=True)
            elif req["kind"] == "get":  # plain module-level values an expr test reads (judged elsewhere)
                result = {}
                for name in req.get("names", ()):
                    if name not in module_ns:
                        raise NameError(f"name {name!r} is not defined")
                    result[name] = module_ns[name]
            else:
                raise ValueError(f"unknown request kind {req['kind']!r}")
            elapsed = _perf() - t0
            wire = _json_dumps(encode_value(result), ensure_ascii=True)
        except _TestTimeout:
            status = "timeout"
        except BaseException as exc:  # noqa: BLE001 - includes SystemExit from the candidate
            status, err, etype = "error", _describe(exc), type(exc).__name__
        finally:
            _disarm()
        if status != "ok":
            elapsed = _perf() - t0
        elif structure_count(wire) + structure_count(after) > self.max_items or len(wire) + len(after) > 4 * self.cap:
            status, etype = "error", "ValueError"
            size = len(wire) + len(after)
            err = (f"return value too large to judge ({structure_count(wire) + structure_count(after)} values, {size} "
                   f"bytes; the limits are {self.max_items} values, {4 * self.cap} bytes)")
        self._collect()
        msg = {"st": status, "t": elapsed, "err": err, "etype": etype}
        return msg, ('"val": ' + wire + (', "args": ' + after if after else "") if status == "ok" else "")


class _CandidateTimeout(BaseException):
    """The candidate ran out of time during a judge step (not catchable by ``except Exception``)."""


class _CandidateDied(BaseException):
    """The candidate's sandbox process died during a judge step."""


class _CandidateRaised(Exception):
    """The candidate raised an exception that is not a builtin exception type."""


class _JudgeAbort(BaseException):
    """The parent closed the command channel in the middle of a step."""


class _JudgeRunner:
    """Runs a dataset's own test code: the steps of its check program, and ``expr`` tests.

    The check program defines a generator ``__vpo_steps__(candidate)`` that yields once per step
    (None, or the exception that ended it); ``candidate`` here is a proxy whose every call is
    answered by the candidate's sandbox through the parent, with plain values only. An ``expr``
    test is evaluated here the same way: each name the solution defines is a proxy of that
    function (or the plain value the parent fetched), so the expression computes on plain data
    and no object of the candidate takes part. A candidate exception raised during a step or an
    expression fails it, whatever the test code does with the exception (a ``StopIteration``
    that ends a ``map`` early, an ``except Exception``)."""

    def __init__(self, cfg: dict, prot: dict) -> None:
        self.cfg = cfg
        self.prot = prot
        self.load_timeout = float(cfg["load_timeout"])
        self.wall_factor = float(cfg["wall_factor"])
        self.max_items = int(cfg["max_value_items"])
        self.cap = int(cfg["max_output_bytes"])
        self.commands = _Commands()
        self.raised: str | None = None
        self.expr_base: dict = {}
        _common_process_setup()
        devnull = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)

    def _call(self, fn: str | None, args: tuple, kwargs: dict) -> object:
        msg = {"ev": "call", "args": encode_value(list(args))}
        if fn is not None:
            msg["fn"] = fn
        if kwargs:
            msg["kw"] = encode_value(dict(kwargs))
        sync = _holds_mutable(args) or _holds_mutable(tuple(kwargs.values()))
        if sync:
            msg["sync"] = 1
        _send(msg)
        reply = self.commands.read()
        if reply is None:
            raise _JudgeAbort()
        if "val" in reply:
            if sync and "args" in reply:  # what the call changed in its arguments, as in-process
                new = decode_value(reply["args"])
                if type(new) is list and len(new) == 2 and type(new[0]) is list and type(new[1]) is dict:
                    for old, value in zip(args, new[0]):
                        _sync_in_place(old, value)
                    for key, old in kwargs.items():
                        if key in new[1]:
                            _sync_in_place(old, new[1][key])
            return decode_value(reply["val"])
        if reply.get("timeout"):
            raise _CandidateTimeout("the candidate timed out")
        if "died" in reply:
            raise _CandidateDied(str(reply["died"]))
        name, text = str(reply.get("exc") or "Exception"), str(reply.get("msg") or "")
        if self.raised is None:
            self.raised = text or name
        etype = getattr(builtins, name, None)
        exc: BaseException = _CandidateRaised(text or name)
        if isinstance(etype, type) and issubclass(etype, Exception):
            try:
                exc = etype(text)
            except Exception:  # noqa: BLE001, S110 - an exception class with a different constructor
                pass
        raise exc

    def _candidate(self, *args: object, **kwargs: object) -> object:
        return self._call(None, args, kwargs)

    def _proxy(self, name: str):
        def call(*args: object, **kwargs: object) -> object:
            return self._call(name, args, kwargs)

        call.__name__ = call.__qualname__ = name
        return call

    def run(self) -> int:
        _send({"ev": "ready", "prot": self.prot})
        _arm(self.load_timeout, self.load_timeout * self.wall_factor)
        gen = None
        try:
            ns = {"__name__": "__main__", "__builtins__": builtins}
            exec(compile(self.cfg["code"], "check.py", "exec"), ns)  # noqa: S102 - the dataset's test code
            if "__vpo_steps__" in ns:
                gen = ns["__vpo_steps__"](self._candidate)
            if self.cfg.get("expr_prelude"):  # the names value expressions take from the job's prelude
                base = {"__builtins__": builtins}
                exec(compile(self.cfg["expr_prelude"], "<prelude>", "exec"), base)  # noqa: S102 - the job's prelude
                self.expr_base = {k: v for k, v in base.items() if not k.startswith("__")}
            err = None
        except _TestTimeout:
            err = "timeout while loading the test code"
        except BaseException as exc:  # noqa: BLE001
            err = _describe(exc)
        finally:
            _disarm()
        if err is not None:
            _send({"ev": "load_error", "msg": err})
            return 0
        _send({"ev": "loaded", "names": sorted(self.expr_base)})
        step = 0
        finished = gen is None
        while True:
            req = self.commands.read()
            if req is None:
                _os_exit(0)
            if "expr" in req:
                self._expr(req)
                continue
            want = int(req["step"])
            while step <= want:
                self.raised = None
                t0 = _perf()
                if finished:
                    outcome = None
                else:
                    try:
                        outcome = next(gen)
                    except StopIteration:  # the test code returned early: later steps are vacuous
                        finished, outcome = True, None
                    except BaseException as exc:  # noqa: BLE001 - outside any step: the test code is broken
                        finished, outcome = True, exc
                if isinstance(outcome, _JudgeAbort):
                    _os_exit(0)
                if step == want:
                    _send({"ev": "step", "k": step, "t": _perf() - t0, **self._verdict(outcome)})
                step += 1

    def _expr(self, req: dict) -> None:
        self.raised = None
        head = {"ev": "value", "k": req.get("k")}
        try:
            ns = {"__builtins__": builtins, **self.expr_base}
            for name in req.get("mods", ()):  # standard-library modules the expression names: the judge's own
                if name in sys.stdlib_module_names:
                    ns[name] = __import__(name)
            ns.update(decode_value(req.get("vals") or {}))
            ns.update({name: self._proxy(name) for name in req.get("fns", ())})
            value = eval(compile(req["expr"], "<test>", "eval"), ns)
            wire = _json_dumps(encode_value(value), ensure_ascii=True)
        except _JudgeAbort:
            _os_exit(0)
        except BaseException as exc:  # noqa: BLE001
            _send({**head, **self._verdict(exc)})
            return
        if self.raised is not None:
            _send({**head, **self._verdict(None)})
        elif structure_count(wire) > self.max_items or len(wire) > 4 * self.cap:
            _send({**head, "st": "error", "err": "the test expression's value is too large to judge"})
        else:
            _send({**head, "st": "ok"}, '"val": ' + wire)

    def _verdict(self, outcome: BaseException | None) -> dict:
        if isinstance(outcome, _CandidateTimeout):
            return {"st": "timeout", "err": "the candidate timed out"}
        if isinstance(outcome, _CandidateDied):
            return {"st": "error", "err": f"the candidate's process died: {outcome}"}
        if self.raised is not None:  # whatever the test code did with it
            return {"st": "error", "err": f"the candidate raised {self.raised}"[:500]}
        if outcome is None:
            return {"st": "ok"}
        if isinstance(outcome, AssertionError):
            return {"st": "fail", "err": "assertion failed" + (f": {_describe(outcome)}" if str(outcome) else "")}
        return {"st": "fail", "err": f"the test raised {_describe(outcome)}"}


_MUTABLE = (list, dict, set)


def _holds_mutable(x: object, depth: int = 0) -> bool:
    """Whether plain value ``x`` holds a list, dict or set a call could change in place."""
    t = type(x)
    if t in _MUTABLE:
        return True
    if t is tuple and depth < MAX_DEPTH:
        return any(_holds_mutable(v, depth + 1) for v in x)
    return False


def _sync_in_place(old: object, new: object, depth: int = 0) -> None:
    """Make ``old`` (the judge's argument) hold what ``new`` (the same argument after the
    candidate's call) holds, keeping the identity of every list, dict and set in it: an in-place
    task (``candidate(a); assert a == ...``) is judged as it is in one process."""
    if depth > MAX_DEPTH:
        return
    t = type(old)
    if t is list and type(new) is list:
        for i in range(min(len(old), len(new))):
            if type(old[i]) in (*_MUTABLE, tuple) and type(old[i]) is type(new[i]):
                _sync_in_place(old[i], new[i], depth + 1)
            if type(old[i]) not in _MUTABLE or type(old[i]) is not type(new[i]):
                old[i] = new[i]
        del old[len(new):]
        old.extend(new[len(old):])
    elif t is dict and type(new) is dict:
        for key in [k for k in old if k not in new]:
            del old[key]
        for key, value in new.items():
            if key in old and type(old[key]) in _MUTABLE and type(old[key]) is type(value):
                _sync_in_place(old[key], value, depth + 1)
            else:
                old[key] = value
    elif t is set and type(new) is set:
        old.clear()
        old.update(new)
    elif t is tuple and type(new) is tuple and len(old) == len(new):
        for a, b in zip(old, new):
            _sync_in_place(a, b, depth + 1)


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
    if len(sys.argv) in (3, 4, 5) and sys.argv[1] == "zygote":
        zygote_main(int(sys.argv[2]), sys.argv[3] if len(sys.argv) >= 4 else "auto",
                    json.loads(sys.argv[4]) if len(sys.argv) == 5 else None)
    else:
        sys.stderr.write("usage: _harness.py zygote SOCKET_FD [auto|off] [SLOT_JSON]\n")
        sys.exit(2)
