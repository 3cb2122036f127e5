"""Adversarial candidates: each attack must be contained, scored as failed, leave the machine as
it was, and not stop the batch it is part of.

All attacks run in ONE batch together with honest control candidates (``batch`` fixture),
while a watcher thread counts the processes of that sandbox (its own cgroup: nothing another
job on the machine runs is ever counted). Attacks are bounded so that a containment failure
cannot take the machine down (the fork bomb makes at most 2^8 processes, the memory bomb stops
at 3 GiB, ``kill(-1)`` is skipped when running as root).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from vpo.sandbox import Job, Sandbox, SandboxConfig, Status, TestCase

pytestmark = [pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="the sandbox needs Linux"),
              pytest.mark.sandbox]

CONFIG = SandboxConfig(
    test_timeout=1.0,
    load_timeout=2.0,
    grace=0.3,
    memory_mb=512,
    max_processes=4,
    max_output_bytes=256 << 10,
    workers=2,
)
TOKEN = "EXPECTED-" + secrets.token_hex(8)  # an expected value no candidate can know


class _Watcher(threading.Thread):
    """Samples the number of processes in one sandbox's own cgroups while the batch runs."""

    def __init__(self, box: Sandbox) -> None:
        super().__init__(daemon=True)
        self.box = box
        self.stop = threading.Event()
        self.peak = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, len(self.box.processes()))
            time.sleep(0.02)


class _Listener(threading.Thread):
    """A TCP server on 127.0.0.1 that records every connection it gets."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.settimeout(0.1)
        self.udp_port = self.udp.getsockname()[1]
        self.connections = 0
        self.datagrams = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.connections += 1
                conn.close()
            except OSError:
                pass
            try:
                self.udp.recv(100)
                self.datagrams += 1
            except OSError:
                pass


def call(code: str, *tests: TestCase) -> Job:
    return Job(textwrap.dedent(code), tests, "f")


def t(*args: object, expected: object = TOKEN) -> TestCase:
    return TestCase.call(list(args), expected)


def attacks(ctx: dict) -> dict[str, Job]:
    """name -> job. Every attack's first test expects TOKEN (or a right answer it can't give)."""
    victim_dir, victim_file = ctx["victim_dir"], ctx["victim_file"]
    return {
        "infinite_loop": call(
            """
            def f(x):
                while x:
                    pass
                return x
            """,
            t(1, expected=1), t(0, expected=0),
        ),
        "c_busy_loop_pow": call("def f(x):\n    return pow(3, 10 ** 8) % 7 if x else x\n", t(1, expected=3), t(0, expected=0)),
        "c_busy_loop_repeat": call(
            "import collections, itertools\ndef f(x):\n    if x:\n        collections.deque(itertools.repeat(0), maxlen=0)\n    return x\n",
            t(1, expected=1), t(0, expected=0),
        ),
        "memory_bomb": call(
            """
            import mmap
            def f(x):
                if x == 0:
                    return len(bytearray(8 << 30))
                # address space held but never touched, so the growth below meets the limit after
                # touching little memory: the check is the limit, not how fast a busy machine faults pages in
                held = mmap.mmap(-1, 320 << 20)
                chunks = []
                for _ in range(30):  # bounded: at most 3 GiB even without a limit
                    chunks.append(bytearray(50 << 20))
                return len(chunks) + len(held)
            """,
            t(0), t(1),
        ),
        "fork_bomb": call(
            """
            import os, time
            def f(x):
                child, made = False, 0
                for level in range(8):  # bounded: at most 2^8 processes without a limit
                    try:
                        pid = os.fork()
                    except OSError:
                        break
                    if pid == 0:
                        child, made = True, 0
                        continue
                    made += 1
                if child:
                    time.sleep(30)
                    os._exit(0)
                return made
            """,
            t(0),
        ),
        "thread_bomb": call(
            """
            import threading, time
            def f(x):
                n = 0
                for _ in range(1000):  # bounded
                    try:
                        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
                    except RuntimeError:
                        break
                    n += 1
                return n
            """,
            t(0),
        ),
        "write_outside_workdir": call(
            f"""
            import os
            def f(x):
                wrote = []
                for p in [{str(victim_dir / 'new.txt')!r}, {str(victim_file)!r}, {ctx['project_file']!r},
                          '/etc/vpo-sbx-pwned', '/usr/vpo-sbx-pwned', '/vpo-sbx-pwned', '/dev/shm/../../vpo-sbx-pwned']:
                    try:
                        with open(p, 'a') as fh:
                            fh.write('pwned')
                        wrote.append(p)
                    except OSError as e:
                        wrote.append(type(e).__name__)
                return wrote
            """,
            t(0),
        ),
        "delete_files": call(
            f"""
            import os, shutil
            def f(x):
                out = []
                for fn in (lambda: os.remove({str(victim_file)!r}), lambda: shutil.rmtree({str(victim_dir)!r}),
                           lambda: os.rename({str(victim_file)!r}, '/tmp/stolen'), lambda: os.remove({ctx['project_file']!r})):
                    try:
                        fn()
                        out.append('deleted')
                    except OSError as e:
                        out.append(type(e).__name__)
                return out
            """,
            t(0),
        ),
        "read_secrets": call(
            f"""
            import os
            def f(x):
                found = [k + '=' + v for k, v in os.environ.items()]
                paths = ['/proc/self/environ', '/proc/1/environ', '/proc/{ctx['victim_pid']}/environ',
                         '/proc/{ctx['victim_pid']}/cmdline', '/proc/{ctx['test_pid']}/environ', {ctx['secret_file']!r}]
                for pid in os.listdir('/proc'):
                    if pid.isdigit():
                        paths.append('/proc/' + pid + '/environ')
                for p in paths:
                    try:
                        with open(p, 'rb') as fh:
                            found.append(fh.read().decode('latin-1'))
                    except OSError:
                        pass
                for d in ('/root', '/home', {os.path.dirname(ctx['project_file'])!r}):
                    try:
                        found.extend(os.listdir(d))
                    except OSError:
                        pass
                return found
            """,
            t(0),
        ),
        "socket_to_localhost": call(
            f"""
            import socket
            def f(x):
                out = []
                try:
                    s = socket.create_connection(('127.0.0.1', {ctx['port']}), timeout=0.5)
                    s.sendall(b'pwned')
                    out.append('connected')
                except OSError as e:
                    out.append(str(e))
                try:
                    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    u.sendto(b'pwned', ('127.0.0.1', {ctx['udp_port']}))
                    out.append('sent')
                except OSError as e:
                    out.append(str(e))
                return out
            """,
            t(0),
        ),
        "kill_parent": call(
            f"""
            import os, signal
            def f(x):
                out = []
                targets = [lambda: os.kill({ctx['test_pid']}, signal.SIGKILL),
                           lambda: os.killpg({ctx['test_pgid']}, signal.SIGKILL),
                           lambda: os.kill({ctx['victim_pid']}, signal.SIGKILL)]
                if os.getuid() != 0:  # bounded: never kill(-1) as real root
                    targets.append(lambda: os.kill(-1, signal.SIGKILL))
                for fn in targets:
                    try:
                        fn()
                        out.append('sent')
                    except OSError as e:
                        out.append(type(e).__name__)
                return out
            """,
            t(0),
        ),
        "kill_own_group": call(
            "import os, signal\ndef f(x):\n    os.killpg(os.getpgid(0), signal.SIGKILL)\n    return x\n",
            t(0),
        ),
        "flood_stdout": Job("while True:\n    print('y' * 1000)\n", (TestCase.stdio("", "y"),)),
        "flood_stdout_raw_fd": Job("import os\nwhile True:\n    os.write(1, b'z' * 65536)\n", (TestCase.stdio("", "z"),)),
        "flood_stdout_one_write": Job("import sys\nsys.stdout.write('x' * (10 ** 9))\n", (TestCase.stdio("", "x"),)),
        "deep_recursion_python": call(
            "import sys\nsys.setrecursionlimit(10 ** 8)\ndef r(n):\n    return r(n + 1) + 1\ndef f(x):\n    return r(0)\n",
            t(0),
        ),
        "deep_recursion_c_stack": call(
            """
            import sys
            class Loop:
                def __getattr__(self, name):  # every level recurses through C: overflows the C stack
                    return getattr(self, name)
            def f(x):
                if x == 0:
                    return x
                sys.setrecursionlimit(10 ** 8)
                return Loop().anything
            """,
            t(1), t(0, expected=0),
        ),
        "sys_exit_in_call": call("import sys\ndef f(x):\n    if x:\n        sys.exit(0)\n    return 5\n", t(1, expected=5), t(0, expected=5)),
        "os_exit_in_call": call("import os\ndef f(x):\n    if x:\n        os._exit(0)\n    return 5\n", t(1, expected=5), t(0, expected=5)),
        "exit_at_module_level": call("import sys\nsys.exit(0)\ndef f(x):\n    return 5\n", t(0, expected=5)),
        "os_exit_at_module_level": call("import os\nos._exit(0)\ndef f(x):\n    return 5\n", t(0, expected=5)),
        "exit_before_output": Job("import sys\nsys.exit(0)\nprint(TOKEN)\n", (TestCase.stdio("", TOKEN),)),
        "eq_override_object": call(
            "class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\ndef f(x):\n    return Yes()\n",
            t(0),
        ),
        "eq_override_int_subclass": call(
            "class Yes(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\ndef f(x):\n    return Yes(0)\n",
            t(0),
        ),
        "override_print": Job(
            "import builtins\nbuiltins.print = lambda *a, **k: None\nprint('nothing')\n", (TestCase.stdio("", TOKEN),)
        ),
        "forge_result_events": call(
            """
            import os
            def f(x):
                fake = b'{"ev": "end", "i": 0, "st": "ok", "val": "forged"}\\n{"ev": "done"}\\n'
                for fd in range(3, 10):
                    try:
                        os.write(fd, fake)
                    except OSError:
                        pass
                return 'forged'
            """,
            t(0), t(1),
        ),
        "patch_harness_and_search_memory": call(
            """
            import gc, sys
            def f(x):
                main = sys.modules['__main__']
                for name in ('encode_value', '_describe'):
                    if hasattr(main, name):
                        setattr(main, name, lambda *a, **k: 'forged')
                seen = [o for o in gc.get_objects() if isinstance(o, str) and o.startswith('EXPECTED-')]
                return seen
            """,
            t(0), t(1),
        ),
        "ignore_alarm_and_spin": call(
            "import signal\ndef f(x):\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    signal.setitimer(signal.ITIMER_REAL, 0)\n"
            "    while True:\n        pass\n",
            t(0),
        ),
        "close_result_channel": call(
            "import os\ndef f(x):\n    for fd in range(3, 64):\n        try:\n            os.close(fd)\n        except OSError:\n            pass\n    return 1\n",
            t(0), t(1),
        ),
        "daemonize_escape": call(
            """
            import os, time
            def f(x):
                if os.fork() == 0:
                    os.setsid()
                    if os.fork() == 0:
                        import signal, ctypes
                        try:
                            ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # clear the parent-death signal
                        except Exception:
                            pass
                        time.sleep(60)
                    os._exit(0)
                return 'spawned'
            """,
            t(0),
        ),
    }


CONTROLS = {
    "honest_call": call("def f(x):\n    return x * 2\n", t(2, expected=4), t(5, expected=10)),
    "honest_stdio": Job("print(sum(map(int, input().split())))\n", (TestCase.stdio("1 2 3", "6"), TestCase.stdio("4", "4"))),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> dict:
    victim_dir = Path("/var/tmp") / f"vpo-sbx-victim-{secrets.token_hex(4)}"
    victim_dir.mkdir()
    os.chmod(victim_dir, 0o777)  # world-writable: only isolation keeps the sandbox out
    victim_file = victim_dir / "keep.txt"
    victim_file.write_text("precious")
    os.chmod(victim_file, 0o666)
    secret = "s3cr3t-" + secrets.token_hex(8)
    secret_file = Path("/root" if os.geteuid() == 0 else Path.home()) / f".vpo-sbx-secret-{secrets.token_hex(4)}"
    secret_file.write_text(secret)
    os.chmod(secret_file, 0o644)
    victim = subprocess.Popen(["sleep", "120"], env={"VPO_VICTIM_SECRET": secret})
    listener = _Listener()
    listener.start()
    os.environ["VPO_PARENT_SECRET"] = secret
    mounts_before = Path("/proc/self/mountinfo").read_text()
    ctx = {
        "victim_dir": victim_dir, "victim_file": victim_file, "secret_file": str(secret_file),
        "victim_pid": victim.pid, "test_pid": os.getpid(), "test_pgid": os.getpgrp(),
        "port": listener.port, "udp_port": listener.udp_port,
        "project_file": str(Path(__file__).resolve().parents[1] / "pyproject.toml"),
    }
    jobs = {**attacks(ctx), **CONTROLS}
    sb = Sandbox(CONFIG)
    uids = sb.uids or range(0)
    watcher = _Watcher(sb)
    watcher.start()
    try:
        t0 = time.monotonic()
        results = sb.run(list(jobs.values()))
        elapsed = time.monotonic() - t0
        leftover = sb.processes()  # the batch has returned: nothing of it may be left
        after_batch = sb.run_one("def f(x):\n    return x + 1\n", [t(1, expected=2)], "f")
        cgroup = sb.cgroup.dirs if sb.cgroup is not None else {}
    finally:
        watcher.stop.set()
        watcher.join()
        sb.close()
        del os.environ["VPO_PARENT_SECRET"]
    listener.stop.set()
    listener.join()
    out = {
        "results": dict(zip(jobs, results)),
        "elapsed": elapsed,
        "after_batch": after_batch,
        "peak_processes": watcher.peak,
        "leftover": leftover,
        "cgroup_removed": all(not os.path.exists(d) for d in cgroup.values()),
        "victim_alive": victim.poll() is None,
        "victim_dir": victim_dir,
        "victim_file": victim_file,
        "victim_dir_listing": sorted(os.listdir(victim_dir)),
        "victim_text": victim_file.read_text() if victim_file.exists() else None,
        "project_file": Path(ctx["project_file"]),
        "secret": secret,
        "secret_file_intact": secret_file.read_text() == secret,
        "listener": listener,
        "mounts_changed": Path("/proc/self/mountinfo").read_text() != mounts_before,
        "tmp_sandbox_files": [p for p in list(Path("/tmp").iterdir()) + list(Path("/var/tmp").iterdir())
                              if _owned_by(p, uids)],
        "stray_paths": [p for p in ("/etc/vpo-sbx-pwned", "/usr/vpo-sbx-pwned", "/vpo-sbx-pwned", "/tmp/stolen")
                        if os.path.exists(p)],
    }
    victim.kill()
    victim.wait()
    shutil.rmtree(victim_dir, ignore_errors=True)
    secret_file.unlink()
    return out


def _owned_by(p: Path, uids: range) -> bool:
    """Whether ``p`` belongs to one of the user ids leased to this test's own sandbox."""
    try:
        return p.lstat().st_uid in uids
    except OSError:
        return False


def res(batch: dict, name: str):
    return batch["results"][name]


def statuses(batch: dict, name: str) -> list[Status]:
    return [x.status for x in res(batch, name).tests]


def assert_failed_first(batch: dict, name: str) -> None:
    first = res(batch, name).tests[0]
    assert first.status is not Status.PASS, (name, first)


# --- the batch as a whole


def test_batch_completes_and_controls_pass(batch: dict) -> None:
    for name in CONTROLS:
        assert res(batch, name).all_passed, (name, res(batch, name).tests)
    assert batch["after_batch"].all_passed
    assert batch["elapsed"] < 60


def test_every_attack_is_scored_failed(batch: dict) -> None:
    for name, result in batch["results"].items():
        if name in CONTROLS:
            continue
        assert result.tests[0].status is not Status.PASS, (name, result.tests[0])


def test_machine_left_as_it_was(batch: dict) -> None:
    assert batch["leftover"] == [], "sandbox processes outlived the batch"
    assert batch["cgroup_removed"]
    assert batch["victim_alive"]
    assert batch["victim_text"] == "precious" and batch["victim_dir_listing"] == ["keep.txt"]
    assert batch["project_file"].exists() and "pwned" not in batch["project_file"].read_text()
    assert batch["secret_file_intact"]
    assert not batch["mounts_changed"]
    assert batch["tmp_sandbox_files"] == []
    assert batch["stray_paths"] == []


# --- individual attacks


def test_infinite_loop_times_out_and_next_test_runs(batch: dict) -> None:
    assert statuses(batch, "infinite_loop") == [Status.TIMEOUT, Status.PASS]


def test_busy_loop_in_c_is_killed(batch: dict) -> None:
    assert statuses(batch, "c_busy_loop_pow") == [Status.TIMEOUT, Status.PASS]
    r = res(batch, "c_busy_loop_repeat")
    assert [x.status for x in r.tests] == [Status.TIMEOUT, Status.PASS]
    # this C loop never checks for signals, so the in-process alarm cannot stop it: the parent
    # killed the sandbox at the CPU time limit and re-ran the remaining test in a fresh one
    assert "CPU time limit" in r.tests[0].detail and r.rounds == 2


def test_memory_bomb_contained(batch: dict) -> None:
    r = res(batch, "memory_bomb")
    assert [x.status for x in r.tests] == [Status.ERROR, Status.ERROR]
    assert all("MemoryError" in x.detail for x in r.tests), r.tests


def test_fork_bomb_contained(batch: dict) -> None:
    r = res(batch, "fork_bomb").tests[0]
    assert r.status is Status.FAIL
    assert int(r.output) <= CONFIG.max_processes - 1
    assert batch["peak_processes"] <= CONFIG.max_processes * CONFIG.workers


def test_thread_bomb_contained(batch: dict) -> None:
    r = res(batch, "thread_bomb").tests[0]
    assert r.status is Status.FAIL
    assert int(r.output) <= CONFIG.max_processes - 1


def test_writes_outside_work_dir_fail(batch: dict) -> None:
    r = res(batch, "write_outside_workdir").tests[0]
    assert r.status is Status.FAIL
    assert all(not item.startswith("/") for item in eval(r.output))


def test_deleting_files_fails(batch: dict) -> None:
    r = res(batch, "delete_files").tests[0]
    assert r.status is Status.FAIL
    assert "deleted" not in eval(r.output)


def test_secrets_not_readable(batch: dict) -> None:
    r = res(batch, "read_secrets").tests[0]
    assert r.status is Status.FAIL
    assert batch["secret"] not in r.output
    found = eval(r.output) if r.output.endswith("]") else []
    assert not any("VPO_PARENT_SECRET" in s or "VPO_VICTIM_SECRET" in s for s in found)
    assert not any(s.startswith(".vpo-sbx-secret") for s in found)


def test_no_network_to_localhost(batch: dict) -> None:
    r = res(batch, "socket_to_localhost").tests[0]
    assert r.status is Status.FAIL
    assert "connected" not in r.output and "'sent'" not in r.output
    assert batch["listener"].connections == 0 and batch["listener"].datagrams == 0


def test_killing_the_parent_fails(batch: dict) -> None:
    r = res(batch, "kill_parent").tests[0]
    assert r.status is Status.FAIL
    assert "sent" not in eval(r.output)[:3]  # test runner, its group, the victim
    assert batch["victim_alive"]
    k = res(batch, "kill_own_group").tests[0]
    # the candidate is pid 1 of its namespace (signals from inside are ignored) or it killed
    # only itself: never a pass, and the batch went on
    assert k.status in (Status.FAIL, Status.ERROR)


def test_stdout_floods_are_cut(batch: dict) -> None:
    for name in ("flood_stdout", "flood_stdout_raw_fd", "flood_stdout_one_write"):
        r = res(batch, name).tests[0]
        assert r.status in (Status.ERROR, Status.FAIL), (name, r)
        assert len(r.output) <= 2003


def test_deep_recursion(batch: dict) -> None:
    assert statuses(batch, "deep_recursion_python")[0] in (Status.ERROR, Status.TIMEOUT)
    r = res(batch, "deep_recursion_c_stack")
    assert [x.status for x in r.tests] == [Status.ERROR, Status.PASS]
    assert "signal" in r.tests[0].detail or "RecursionError" in r.tests[0].detail or "MemoryError" in r.tests[0].detail


def test_exit_tricks(batch: dict) -> None:
    assert statuses(batch, "sys_exit_in_call") == [Status.ERROR, Status.PASS]
    assert "SystemExit" in res(batch, "sys_exit_in_call").tests[0].detail
    assert statuses(batch, "os_exit_in_call") == [Status.ERROR, Status.PASS]
    assert statuses(batch, "exit_at_module_level") == [Status.ERROR]
    assert statuses(batch, "os_exit_at_module_level") == [Status.ERROR]
    assert statuses(batch, "exit_before_output") == [Status.FAIL]


def test_harness_tampering(batch: dict) -> None:
    assert statuses(batch, "eq_override_object") == [Status.ERROR]
    assert statuses(batch, "eq_override_int_subclass") == [Status.FAIL]
    assert statuses(batch, "override_print") == [Status.FAIL]
    forged = res(batch, "forge_result_events")
    assert [x.status for x in forged.tests] == [Status.ERROR, Status.ERROR]
    assert all("protocol violation" in x.detail for x in forged.tests)
    patched = res(batch, "patch_harness_and_search_memory")
    assert all(x.status is not Status.PASS for x in patched.tests)
    assert TOKEN not in "".join(x.output for x in patched.tests)
    assert statuses(batch, "ignore_alarm_and_spin") == [Status.TIMEOUT]
    assert all(x.status is not Status.PASS for x in res(batch, "close_result_channel").tests)


def test_daemonized_grandchild_does_not_survive(batch: dict) -> None:
    assert statuses(batch, "daemonize_escape") == [Status.FAIL]
    assert batch["leftover"] == []


# --- read-only root without hiding, and the unprivileged (user namespace) mode


def test_minimal_read_only_nodev_view() -> None:
    """Only the system folders and the interpreter exist in the sandbox, read-only; a
    world-writable folder elsewhere does not exist at all; /dev holds five devices; every mount
    but those five devices is nodev."""
    victim_dir = Path("/var/tmp") / f"vpo-sbx-ro-{secrets.token_hex(4)}"
    victim_dir.mkdir()
    os.chmod(victim_dir, 0o777)
    code = textwrap.dedent(f"""
        import os
        def f(x):
            out = {{"victim": os.path.exists({str(victim_dir)!r}), "root": sorted(os.listdir("/")),
                    "dev": sorted(os.listdir("/dev"))}}
            for p in ("/usr/vpo-w", "/etc/vpo-w", "/vpo-w", "/dev/vpo-w"):
                try:
                    open(p, "w").write("x")
                    out[p] = "wrote"
                except OSError as e:
                    out[p] = e.errno
            with open("/dev/null", "w") as fh:
                fh.write("fine")
            out["nodev"] = [line.split()[4] for line in open("/proc/self/mountinfo")
                            if "nodev" not in line.split()[5]]
            out["tmp"] = open("/tmp/w", "w").write("ok")
            return out
    """)
    try:
        with Sandbox(SandboxConfig(workers=1)) as box:
            r = box.run_one(code, [t(0)], "f")
            if r.protections.get("mode") == "none":
                pytest.skip("no namespaces here")
        import errno

        out = eval(r.tests[0].output)
        assert out["victim"] is False
        assert set(out["root"]) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "tmp", "dev", "proc",
                                    "root", ".old", ".vpo-empty"}, out["root"]
        assert set(out["dev"]) == {"null", "zero", "full", "random", "urandom", "shm", "fd", "stdin", "stdout", "stderr"}
        assert all(out[p] in (errno.EROFS, errno.EACCES) for p in ("/usr/vpo-w", "/etc/vpo-w", "/vpo-w", "/dev/vpo-w"))
        assert sorted(out["nodev"]) == ["/dev/full", "/dev/null", "/dev/random", "/dev/urandom", "/dev/zero"]
        assert out["tmp"] == 2
        prot = r.protections
        assert prot["view"] == "minimal" and prot["nodev"] and prot["readonly_root"] and prot["seccomp"]
        assert prot["keyring"] in ("fresh", "none in kernel")
        assert os.listdir(victim_dir) == []
    finally:
        shutil.rmtree(victim_dir, ignore_errors=True)


USERNS_SCRIPT = """
import json, os
from vpo.sandbox import Sandbox, SandboxConfig, SandboxError, TestCase
bomb = '''
import os, time
def f(x):
    n = 0
    for _ in range(50):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(20)
            os._exit(0)
        n += 1
    return n
'''
net = '''
import socket
def f(x):
    try:
        socket.create_connection(("127.0.0.1", 1), timeout=0.5)
        return "connected"
    except OSError as e:
        return e.errno
'''
try:
    Sandbox(SandboxConfig(python="/usr/bin/python3", workers=1))
    refused = ""
except SandboxError as exc:  # no cgroup for this user: refused unless the fallback is chosen by name
    refused = str(exc)
with Sandbox(SandboxConfig(python="/usr/bin/python3", workers=1, test_timeout=2, cgroups="auto")) as sb:
    a = sb.run_one(bomb, [TestCase.call([0], -1)], "f")
    b = sb.run_one(net, [TestCase.call([0], -1)], "f")
    c = sb.run_one("print(int(input()) + 1)", [TestCase.stdio("41", "42")])
    left = sb.processes()
print(json.dumps({"prot": a.protections, "forks": a.tests[0].output, "net": b.tests[0].output, "ok": c.all_passed,
                  "left": left, "refused": refused}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
                    reason="needs root (to switch to an unprivileged user), setpriv and a system python3")
def test_unprivileged_user_gets_user_namespace_isolation() -> None:
    repo = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", USERNS_SCRIPT],
        capture_output=True, text=True, timeout=120, cwd="/", check=False, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": repo},
    )
    if proc.returncode != 0 and "Operation not permitted" in proc.stderr and "unshare" in proc.stderr:
        pytest.skip("unprivileged user namespaces disabled")
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    prot = out["prot"]
    if prot["mode"] == "none":
        pytest.skip(f"unprivileged user namespaces unavailable: {prot['warnings']}")
    assert prot["mode"] == "userns" and prot["netns"] and prot["pidns"] and prot["nproc_enforced"]
    assert prot["caps"] == "0000000000000000"
    assert int(out["forks"]) <= SandboxConfig().max_processes - 1
    assert out["net"] == "101"  # ENETUNREACH
    assert out["ok"]
    assert out["left"] == []
    if prot["cgroup"]["version"] is None:  # the fallback, chosen by name, and said so
        assert "cgroups='auto'" in out["refused"], out["refused"]
        assert prot["cgroup"]["why"] and prot["missing"] == [{"what": "cgroup", "why": prot["cgroup"]["why"]}]
