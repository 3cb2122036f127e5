"""Sandbox limits that hold under load and fail closed: no candidate can change another's verdict,
take the host's view, or outlive its batch.

* every hostile class of ``tests/support/hostile.py`` runs in ONE batch with honest candidates:
  each is contained, every honest verdict is a pass, and nothing of the batch is alive when
  ``run()`` returns (checked in the sandbox's own cgroup, never by scanning the machine);
* a protection that cannot be set up refuses: one SandboxError at start-up, an ERROR verdict
  naming the cause later; a weaker mode runs only when named, and the protections say so;
* cgroups: the limits in force on v1 (this machine) and the v2 layout on a scratch tree;
* two Sandbox instances in two processes lease disjoint user ids and cgroups;
* ``site_packages=True`` with the interpreter's virtualenv under /tmp gives the minimal view.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.hostile import CONFIG, HOSTILE, LEFTOVER, check_batch, group_jobs
from vpo.sandbox import Job, Sandbox, SandboxConfig, SandboxError, Status, TestCase, cgroups
from vpo.sandbox.leases import BLOCK, UidLease, lease_dir

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="the sandbox needs Linux")
REPO = Path(__file__).resolve().parents[1]


def _cgroups_here() -> bool:
    return not isinstance(cgroups.detect(), str)


@pytest.fixture(scope="module")
def batch() -> dict:
    names, jobs = group_jobs("base")
    order = sorted(range(len(jobs)), key=lambda i: (i % 3, i))  # honest candidates spread among the hostile ones
    with Sandbox(CONFIG) as box:
        t0 = time.monotonic()
        results = box.run([jobs[i] for i in order])
        elapsed = time.monotonic() - t0
        leftover = box.processes()
        cg = box.cgroup
        dirs = sorted(set(cg.dirs.values())) if cg is not None else []
    by_index = dict(zip(order, results))
    return {"names": names, "results": [by_index[i] for i in range(len(jobs))], "leftover": leftover,
            "elapsed": elapsed, "dirs": dirs}


@pytest.mark.sandbox
@pytest.mark.slow  # one batch of every hostile class (~20 s)
def test_every_hostile_class_is_contained_and_honest_verdicts_hold(batch: dict) -> None:
    report = check_batch(batch["names"], batch["results"], batch["leftover"])
    escaped = {name: why for name, why in report.items() if why is not None}
    assert not escaped, escaped
    assert len(HOSTILE) >= 37
    assert all(not os.path.exists(d) for d in batch["dirs"]), "the sandbox's cgroups outlived close()"


@pytest.mark.sandbox
def test_hostile_results_say_what_stopped_them(batch: dict) -> None:
    res = dict(zip(batch["names"], batch["results"]))
    assert "CPU time limit" in res["cpu_in_child_processes"].tests[0].detail or \
        res["cpu_in_child_processes"].tests[0].detail == "time limit exceeded"
    assert res["cpu_gil_free_threads"].cpu >= CONFIG.test_timeout  # its threads' time is its own
    budget = res["slow_to_decode_budget"]
    assert budget.tests[0].cpu > 0 and "budget" in budget.tests[-1].detail  # the parent's decoding is charged to it
    assert res["lingers_with_patched_exit"].all_passed and res["lingers_as_a_daemon"].all_passed
    assert LEFTOVER not in batch["names"]


# --- failing closed


@pytest.mark.sandbox
def test_a_protection_that_cannot_be_set_up_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox whose cgroup cannot be joined does not run its candidate: at start-up one
    SandboxError naming the cause and the setting that would accept it; for a candidate after
    start-up, an ERROR verdict naming the cause. Named as accepted, it runs and says so."""
    if not _cgroups_here():
        pytest.skip("no cgroup here")
    real = cgroups.Instance.leaf

    def broken(self, slot, limits):
        leaf = real(self, slot, limits)
        leaf.procs = [p + "-missing" for p in leaf.procs]
        return leaf

    honest = Job("print(1)", (TestCase.stdio("", "1"),))
    with Sandbox(SandboxConfig(workers=1)) as box:
        box.start()
        monkeypatch.setattr(cgroups.Instance, "leaf", broken)
        for z in list(box._zygotes):
            box._discard(z)
        late = box.run([honest])[0]
    assert late.tests[0].status is Status.ERROR, late.tests
    assert "refused" in late.tests[0].detail and "cgroup" in late.tests[0].detail and "cgroups='auto'" in late.tests[0].detail
    with Sandbox(SandboxConfig(workers=1)) as box, pytest.raises(SandboxError, match="cgroup: cannot join"):
        box.run([honest])
    with Sandbox(SandboxConfig(workers=1, cgroups="auto")) as box:
        res = box.run([honest])[0]
    assert res.all_passed
    assert res.protections["cgroup"]["version"] is None
    assert [m["what"] for m in res.protections["missing"]] == ["cgroup"]


def test_no_cgroup_at_all_refuses_at_start_unless_the_fallback_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroups, "detect", lambda root="/": "cgroup v1 has no memory hierarchy")
    with pytest.raises(SandboxError, match=r"no cgroup can be made here \(cgroup v1 has no memory hierarchy\).*cgroups='auto'"):
        Sandbox(SandboxConfig(workers=1))
    with Sandbox(SandboxConfig(workers=1, cgroups="auto")) as box:
        res = box.run_one("def f(x):\n    return x\n", [TestCase.call([2], 2)], "f")
    assert res.all_passed
    assert res.protections["cgroup"] == {"version": None, "why": "cgroup v1 has no memory hierarchy"}


# --- cgroups


@pytest.mark.sandbox
def test_cgroup_limits_in_force_and_reported() -> None:
    if not _cgroups_here():
        pytest.skip("no cgroup here")
    cfg = SandboxConfig(workers=1, memory_mb=300, max_processes=5, cpus=0.5)
    with Sandbox(cfg) as box:
        prot = box.probe()
        leaf = next(iter(box.cgroup.leaves.values()))
        hier = box.cgroup.hier
        files = {"memory": ("memory.limit_in_bytes", "memory.max"), "pids": ("pids.max", "pids.max"),
                 "cpu": ("cpu.cfs_quota_us", "cpu.max")}
        got = {c: Path(leaf.dirs[c], names[hier.version == "v2"]).read_text().split()[0] for c, names in files.items()}
        io_ctrl = "io" if hier.version == "v2" else "blkio"
        io_file = "io.max" if hier.version == "v2" else "blkio.throttle.read_bps_device"
        io_set = Path(leaf.dirs[io_ctrl], io_file).read_text() if io_ctrl in leaf.dirs else ""
        members = leaf.pids()
        server = next(iter(box._zygotes)).proc.pid
    assert prot["cgroup"]["version"] == hier.version and prot["cgroup"]["memory_bytes"] == 300 << 20
    # pids: + the fork server (+ the intermediate process when not root); cpu: half of a 100 ms period
    assert got == {"memory": str(300 << 20), "pids": str(5 + (1 if os.geteuid() == 0 else 2)), "cpu": "50000"}
    assert members == [server]  # between sandboxes only the fork server is in its slot's group
    assert prot["time"] == "cpu" and prot["missing"] == []
    assert "flock" in prot["shared_file_channels"] and "mincore" in prot["page_cache"]
    io = prot["cgroup"]["io"]  # where the hierarchy has an io controller and the view is on a disk: limited
    if io.get("devices"):
        assert io["bps"] == cfg.io_mbps << 20 and io["iops"] == cfg.io_iops
        assert all(f"{dev} {cfg.io_mbps << 20}" in io_set or f"{dev} rbps={cfg.io_mbps << 20}" in io_set
                   for dev in io["devices"]), io_set
    else:
        assert io["why"], io


def test_cgroup_v2_layout_on_a_scratch_tree(tmp_path: Path) -> None:
    """v2 (not mounted with controllers on this machine): the project's group goes beside this
    process's own (which holds processes), controllers enabled, limits written as v2 names."""
    root = tmp_path
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/mountinfo").write_text(
        "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    (root / "proc/self/cgroup").write_text("0::/ci.slice/job.scope\n")
    own = root / "sys/fs/cgroup/ci.slice/job.scope"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpu memory pids\n")
    (own.parent / "cgroup.subtree_control").write_text("cpu memory pids\n")
    hier = cgroups.detect(str(root))
    assert isinstance(hier, cgroups.Hierarchy), hier
    group = own.parent / "vpo"
    assert hier.version == "v2" and hier.unique_dirs() == [str(group)]
    assert (group / "cgroup.subtree_control").read_text().split() == ["+memory", "+pids", "+cpu"]
    inst = cgroups.Instance(hier, workers=3)
    leaf = inst.leaf(2, cgroups.Limits(256 << 20, 5, 1.5))
    d = Path(leaf.dirs["memory"])
    assert d == group / inst.name / "s2"
    assert (d / "memory.max").read_text() == str(256 << 20) and (d / "pids.max").read_text() == "5"
    assert (d / "cpu.max").read_text() == "150000 100000"
    assert (group / inst.name / "cpu.weight").read_text() == "300"
    (d / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\n")
    assert leaf.cpu_seconds() == 2.5
    assert [leaf.procs] == [[str(d / "cgroup.procs")]]


# --- user ids and cgroups of concurrent instances


HOLDER = textwrap.dedent("""
    import json, sys
    from vpo.sandbox import Sandbox, SandboxConfig, TestCase
    with Sandbox(SandboxConfig(workers=1)) as box:
        r = box.run_one("import os\\nprint(os.getuid())", [TestCase.stdio("", "0")])
        print(json.dumps({"uids": [box.uids.start, box.uids.stop] if box.uids else None, "ran_as": r.tests[0].output.strip(),
                          "cgroup": box.cgroup.name if box.cgroup else None}), flush=True)
        sys.stdin.readline()  # hold everything until the test has seen both
""")


@pytest.mark.sandbox
def test_two_instances_in_two_processes_get_disjoint_ids_and_groups() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd="/") for _ in range(2)]
    try:
        out = [json.loads(p.stdout.readline()) for p in procs]
    finally:
        for p in procs:
            p.communicate("\n", timeout=60)
    assert all(p.returncode == 0 for p in procs), [p.stderr for p in procs]
    if os.geteuid() == 0:
        (a0, a1), (b0, b1) = out[0]["uids"], out[1]["uids"]
        assert a1 - a0 == BLOCK and (a1 <= b0 or b1 <= a0), out
        assert int(out[0]["ran_as"]) in range(a0, a1) and int(out[1]["ran_as"]) in range(b0, b1)
    if out[0]["cgroup"] is not None:
        assert out[0]["cgroup"] != out[1]["cgroup"]


@pytest.mark.sandbox
def test_fork_servers_never_outnumber_their_slots() -> None:
    """Each fork server has a slot (one uid, one cgroup leaf). While every fork server is in use
    (or held by another thread that is only looking at it), a request waits for one to come
    back instead of starting one more."""
    import threading

    with Sandbox(SandboxConfig(workers=1)) as box:
        box.start()
        held = [box._acquire() for _ in range(box._max_zygotes)]
        assert len(box._zygotes) == box._max_zygotes == len(held)
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(box._acquire()), daemon=True)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not got and len(box._zygotes) == box._max_zygotes
        box._release(held[0])
        waiter.join(10)
        assert got == [held[0]]
        for z in held[1:] + got:
            box._release(z)


@pytest.mark.sandbox
def test_a_slot_still_being_freed_is_waited_for_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork server being discarded leaves the pool before its slot is free again (its cgroup
    leaf is emptied first, which takes a while on a busy machine). A request in that window waits
    for the slot; it is not refused as if the slot's processes could not be killed."""
    import threading

    with Sandbox(SandboxConfig(workers=1)) as box:
        box.start()
        held = [box._acquire() for _ in range(box._max_zygotes)]
        freeing, gate = threading.Event(), threading.Event()
        free_slot = box._free_slot

        def slow_free(slot: int) -> None:
            freeing.set()
            assert gate.wait(30)
            free_slot(slot)

        monkeypatch.setattr(box, "_free_slot", slow_free)
        discard = threading.Thread(target=box._discard, args=(held[0],), daemon=True)
        discard.start()
        assert freeing.wait(30)
        assert held[0] not in box._zygotes  # gone from the pool, its slot not yet back
        got: list = []
        errors: list = []

        def request() -> None:
            try:
                got.append(box._acquire())
            except Exception as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        waiter = threading.Thread(target=request, daemon=True)
        waiter.start()
        waiter.join(0.5)
        assert not errors, errors
        assert waiter.is_alive() and not got
        gate.set()
        discard.join(30)
        waiter.join(30)
        assert not errors, errors
        assert len(got) == 1 and got[0].slot == held[0].slot and got[0] is not held[0]
        assert len(box._zygotes) == box._max_zygotes
        for z in held[1:] + got:
            box._release(z)


@pytest.mark.sandbox
def test_slots_whose_processes_survive_stay_out_of_use_until_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot whose cgroup still holds processes after the kill keeps its uid and leaf out of use:
    each request kills again, and refuses with one error while no slot is clean; once the kill
    succeeds the slot is used again."""
    if not _cgroups_here():
        pytest.skip("no cgroup here: slots are freed without one")
    with Sandbox(SandboxConfig(workers=1)) as box:
        box.start()
        kills: list[int] = []
        real_kill = cgroups.Leaf.kill

        def surviving(leaf: cgroups.Leaf, *args: object, **kwargs: object) -> bool:
            kills.append(1)
            real_kill(leaf, *args, **kwargs)
            return False

        held = [box._acquire() for _ in range(box._max_zygotes)]
        monkeypatch.setattr(cgroups.Leaf, "kill", surviving)
        for z in held:
            box._discard(z)
        assert sorted(box._dirty) == list(range(box._max_zygotes)) and not box._free_slots
        for _ in range(2):  # every request tries every slot again; none is reported clean
            before = len(kills)
            with pytest.raises(SandboxError, match="cannot be killed"):
                box._acquire()
            assert len(kills) - before == box._max_zygotes
        monkeypatch.setattr(cgroups.Leaf, "kill", real_kill)
        res = box.run_one("def f(x):\n    return x\n", [TestCase.call([2], 2)], "f")
    assert res.all_passed, res.tests


def test_a_lease_is_free_again_when_its_holder_dies() -> None:
    if os.geteuid() != 0:
        pytest.skip("user ids are leased only as root")
    code = ("import sys, time\nfrom vpo.sandbox.leases import UidLease\nlease = UidLease(int(sys.argv[1]))\n"
            "print(lease.index, flush=True)\ntime.sleep(60)\n")
    base = 2_000_000_000 + secrets.randbelow(1000) * 4096  # a range no sandbox of this suite uses
    holder = subprocess.Popen([sys.executable, "-c", code, str(base)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        index = int(holder.stdout.readline())
        from filelock import FileLock, Timeout

        lock = FileLock(lease_dir() / f"uids-{base}-{index}.lock", timeout=0)
        with pytest.raises(Timeout):
            lock.acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        lock.acquire()  # the kernel dropped the dead holder's lock
        lock.release()
        mine = UidLease(base)
        assert mine.first in range(base, base + 1024 * BLOCK, BLOCK)
        mine.release()
    finally:
        holder.kill()
        holder.wait()


# --- the view with site-packages, the interpreter's virtualenv under /tmp


@pytest.mark.sandbox
def test_site_packages_with_a_virtualenv_under_tmp_gives_the_minimal_view(tmp_path: Path) -> None:
    """The view is staged where it cannot collide with what it exposes: a virtualenv (or a
    checkout) under /tmp lands inside the sandbox's own /tmp, read-only, and nothing else of the
    host's /tmp is there."""
    base = Path("/tmp") / f"vpo-sbx-venv-{secrets.token_hex(4)}"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], check=True, timeout=120)
        (base / "dataset.jsonl").write_text('{"expected": "SECRET"}\n')
        site = next((base / "venv" / "lib").glob("python3*/site-packages"))
        (site / "vpo_sbx_probe.py").write_text("VALUE = 41\n")
        code = textwrap.dedent(f"""
            import os
            def f(x):
                import vpo_sbx_probe
                out = {{"import": vpo_sbx_probe.VALUE + 1, "tmp": sorted(os.listdir('/tmp')),
                        "data": os.path.exists({str(base / 'dataset.jsonl')!r}), "pid1": os.getpid()}}
                try:
                    open({str(site / 'x.py')!r}, 'w')
                    out["venv"] = "writable"
                except OSError as e:
                    out["venv"] = e.errno
                return out
        """)
        with Sandbox(SandboxConfig(workers=1, python=str(base / "venv" / "bin" / "python"), site_packages=True)) as box:
            r = box.run_one(code, [TestCase.call([0], None)], "f")
        out = eval(r.tests[0].output)  # plain data rendered by the parent
        assert r.protections["view"] == "minimal" and r.protections["missing"] == [], r.protections
        assert out["import"] == 42 and out["data"] is False and out["venv"] == 30  # EROFS
        assert set(out["tmp"]) == {base.name, "work"}, out["tmp"]  # the venv's folder and the work dir only
        assert str(base / "venv") in r.protections["exposed"]
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)
