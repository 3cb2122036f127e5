"""Arms on several machines, on one machine: the retrain flow in work-pool mode (``vpo flow --arms-on``).

A local Prefect server (``prefect server start`` on a free port, its own PREFECT_HOME), a process work
pool, the ``train-arm-process`` deployment as ``prefect.yaml`` declares it (entrypoint and pull step),
two ``prefect worker start --limit 1`` processes each in its own clone of a git + DVC repository, and
moto's S3 server on loopback as the DVC remote and registry. ``vpo flow --quick --arms-on ...`` in a
third checkout must train its two arm runs at the same time on the two workers (different checkouts,
overlapping times), and end with a registry and ``dvc status`` that agree with its workspace.

Also: a Prefect global concurrency limit keeps a second holder out at once, naming the limit.

Every process started here is a child of this test in its own process group, stopped at the end.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.repos import DVC, REPO, make_repo, run, tool_env

# about two minutes on a quiet 2-core machine; a loaded one (other suites at once) can take ten times that
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2400)]

POOL = "vpo-test-pool"
ARMS = ("grpo-s0", "vpo-s0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _small_quick(repo: Path) -> None:
    """Two arms, two steps, no search: the mechanics, fast. The quick preset's base (a 1-layer one
    parsed its answers but scored zero everywhere, so neither arm moved); completions cut at the token
    limit are scored too, so both arms get non-zero advantages and their weights move apart."""
    path = repo / "pipelines.yaml"
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    route = raw["pipelines"]["route"]
    route["trainer"]["truncated_scores_zero"] = False
    quick = route["quick"]
    quick.setdefault("arms", {}).update(grpo_x3={"enabled": False}, max_at_k={"enabled": False})
    quick["trainer"].update(max_steps=2, save_steps=2)
    quick["evaluation"].update(n_samples=5, max_problems=4)
    quick["search"] = {"enabled": False}
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    run([sys.executable, "-m", "vpo.pipeline.cli", "dvc"], repo)
    git = ["git", "-c", "user.name=vpo-tests", "-c", "user.email=tests@vpo.invalid"]
    run([*git, "commit", "-qam", "small quick preset"], repo)


class Started:
    """Processes this test starts, each leading its own process group; all stopped at the end."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(self, name: str, cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append((name, proc, log))
        return proc

    def stop(self) -> None:
        from vpo.pipeline.engine.processes import kill_group

        for _, proc, _ in reversed(self.procs):
            kill_group(proc)

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{log.read_text(errors='replace')[-3000:]}" for name, _, log in self.procs)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> Iterator[dict[str, Any]]:
    """Server, pool, deployment, two workers in their own checkouts, and the repository the flow runs
    in (S3 remote and registry in a fresh bucket)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    from flows.server import LocalServer

    root = tmp_path_factory.mktemp("pool")
    bucket = s3_server.make_bucket()
    repo = make_repo(root / "repo", storage={"dvc_remote": f"s3://{bucket}/dvc", "registry": f"s3://{bucket}/registry"})
    _small_quick(repo)
    checkouts = []
    for name in ("w1", "w2"):
        run(["git", "clone", "-q", str(repo), str(root / name)], root)
        checkouts.append(root / name)
    server = LocalServer(root / "server-home", _free_port())
    server.start()
    started = Started()
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
            client.create_work_pool(WorkPoolCreate(name=POOL, type="process",
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))
            spec = next(d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
                        if d["name"] == "train-arm-process")
            pull = yaml.safe_load((REPO / "prefect.yaml").read_text())["pull"]
            flow_id = client.create_flow_from_name("train-arm")
            client.create_deployment(flow_id=flow_id, name=spec["name"], entrypoint=spec["entrypoint"],
                                     work_pool_name=POOL, pull_steps=pull, tags=spec["tags"],
                                     job_variables=spec["work_pool"]["job_variables"], enforce_parameter_schema=False)
        base_env = tool_env(PREFECT_API_URL=server.api_url, OMP_NUM_THREADS="1", PREFECT_WORKER_QUERY_SECONDS="1",
                            PREFECT_WORKER_PREFETCH_SECONDS="1", PYTHONUNBUFFERED="1")
        base_env.pop("VPO_RUN_LOCK", None)
        workers = []
        for checkout in checkouts:
            env = {**base_env, "VPO_REPO_DIR": str(checkout), "PREFECT_HOME": str(root / f"home-{checkout.name}")}
            workers.append(started.start(
                f"worker {checkout.name}", [str(Path(sys.executable).with_name("prefect")), "worker", "start",
                                            "--pool", POOL, "--name", checkout.name, "--limit", "1", "--type", "process"],
                checkout, env, root / f"worker-{checkout.name}.log"))
        deadline = time.monotonic() + 180
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
            while len({w.name for w in client.read_workers_for_work_pool(POOL)}) < 2:
                assert all(w.poll() is None for w in workers), started.logs()
                assert time.monotonic() < deadline, "the workers never came online\n" + started.logs()
                time.sleep(1)
        yield {"server": server, "repo": repo, "bucket": bucket, "checkouts": checkouts, "env": base_env,
               "root": root, "started": started, "workers": workers}
    finally:
        started.stop()
        server.stop()


def test_two_arms_train_at_the_same_time_on_two_workers(pool: dict[str, Any]) -> None:
    """`vpo flow --quick --arms-on train-arm/train-arm-process`: each arm run is a flow run of the
    deployment, the two run on different workers (checkouts) at overlapping times, the flow pulls their
    outputs, evaluates and registers; the registry verifies against the workspace, `dvc status` is clean
    and the remote holds every output."""
    from vpo.pipeline.engine.checkpoints import content_hash
    from vpo.pipeline.registry import Registry

    repo, root = pool["repo"], pool["root"]
    env = {**pool["env"], "PREFECT_HOME": str(root / "home-flow")}
    proc = subprocess.run([sys.executable, "-m", "vpo.pipeline.cli", "flow", "--quick", "--arms-on",
                           "train-arm/train-arm-process"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=900, check=False, start_new_session=True)
    out = proc.stdout + proc.stderr
    (root / "flow.log").write_text(out)
    assert proc.returncode == 0, out[-6000:] + pool["started"].logs()
    trained = {}
    for line in out.splitlines():
        for rid in ARMS:
            if f"train@{rid} trained on " in line:
                checkout = line.split("checkout ", 1)[1].split(")", 1)[0]
                started_at, ended_at = line.split(" from ", 1)[1].split(": ", 1)[0].split(" to ")
                trained[rid] = (checkout, datetime.fromisoformat(started_at), datetime.fromisoformat(ended_at))
    assert set(trained) == set(ARMS), out[-4000:]
    (c1, s1, e1), (c2, s2, e2) = trained["grpo-s0"], trained["vpo-s0"]
    assert {c1, c2} == {str(c) for c in pool["checkouts"]}, trained  # one arm on each worker
    assert s1 < e2 and s2 < e1, f"the two arms did not overlap: {trained}"
    print("\n".join(line for line in out.splitlines() if " trained on " in line or "training runs on work pool" in line))
    bucket = pool["bucket"]
    hashes = {rid: content_hash(repo / "runs" / "route-quick" / "arms" / rid / "model") for rid in ARMS}
    assert len(set(hashes.values())) == 2, "the two arms ended with the same weights: the check below proves little"
    registry = Registry(f"s3://{bucket}/registry", repo)
    entries = registry.scan()[0]
    assert {str(e.arm): e.hash for e in entries} == hashes  # what the workers trained, pulled here, registered
    for e in entries:  # fetched through DVC (cache, else the S3 remote) and re-hashed
        assert registry.verify(e) == [], e.label
    status = run([DVC, "status"], repo)
    assert "Data and pipelines are up to date" in status.stdout, status.stdout
    targets = [n for n in yaml.safe_load((repo / "dvc.lock").read_text())["stages"] if n.startswith("route-quick-")]
    cloud = run([DVC, "status", "-c", "-r", "storage", *targets], repo)
    assert "in sync" in cloud.stdout, cloud.stdout
    for checkout in pool["checkouts"]:  # each worker trained in its own checkout only
        trained_here = [rid for rid in ARMS if (checkout / "runs" / "route-quick" / "arms" / rid / "model").is_dir()]
        assert len(trained_here) == 1, (checkout, trained_here)


def test_a_global_concurrency_limit_keeps_a_second_holder_out_at_once(pool: dict[str, Any]) -> None:
    """Two holders of one `vpo-train-...` limit: the second fails at once naming the limit; once the
    first releases, it gets it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.locks import Busy, exclusive, train_limit

    name = train_limit("route-quick", "probe-s0")
    held, release = threading.Event(), threading.Event()

    def first() -> None:
        with temporary_settings(updates={PREFECT_API_URL: pool["server"].api_url}), exclusive(name, "probe"):
            held.set()
            release.wait(60)

    holder = threading.Thread(target=first, daemon=True)
    holder.start()
    assert held.wait(60)
    with temporary_settings(updates={PREFECT_API_URL: pool["server"].api_url}):
        with pytest.raises(Busy, match=f"limit '{name}' has no free slot"), exclusive(name, "probe"):
            pass
        release.set()
        holder.join(30)
        with exclusive(name, "probe"):
            pass
