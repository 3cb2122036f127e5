"""The ``train-node`` flow: one node of a multi-node training run, as its own flow run of a work pool.

:func:`start_nodes` (from a flow or a script) starts one flow run of the ``train-node`` deployment per node; node 0's goes to the work queue a worker
on the head machine serves (its address is ``main_addr``, the one every node reaches), the others to the
pool's default queue. Each flow run runs the same ``vpo stage train --arm A --seed S`` in its worker's
checkout with ``VPO_NODE_RANK`` / ``VPO_MAIN_ADDR`` / ``VPO_MAIN_PORT`` set
(:func:`vpo.pipeline.engine.nodes.node_env`), streaming its output into the flow run's log; node 0
publishes and records the run. ``execution.max_parallel`` is untouched: each run is one set of node jobs.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.tasks import run_stage, vpo_cmd
from vpo.pipeline.config.names import run_id, variant_name
from vpo.pipeline.engine.nodes import DEFAULT_PORT, node_argv, node_env
from vpo.pipeline.engine.processes import children_stop_first

__all__ = ["HEAD_QUEUE", "node_runs", "start_nodes", "train_node"]

HEAD_QUEUE = "vpo-head"
"""The work queue node 0's flow run goes to: served by a worker on the machine at ``main_addr``."""


@flow(name="train-node", log_prints=True)
def train_node(pipeline: str, quick: bool, arm: str, seed: int, node_rank: int, main_addr: str,
               main_port: int = DEFAULT_PORT, config: str = "pipelines.yaml", sets: list[str] | None = None,
               repo: str = ".") -> dict[str, Any]:
    """Run node ``node_rank``'s part of run ``<arm>-s<seed>`` in this worker's checkout (``repo``)."""
    with children_stop_first():  # a signal stops the stage process before Prefect's engine sees it
        label = f"train@{run_id(arm, seed)}-node{node_rank}"
        argv = node_argv(arm, seed, pipeline=pipeline, config=config, quick=quick, sets=sets or ())
        return run_stage.with_options(task_run_name=label)(
            label, vpo_cmd(*argv), repo, False, variant_name(pipeline, quick), None,
            node_env(node_rank, main_addr, main_port))


def node_runs(pipeline: str, quick: bool, arm: str, seed: int, nodes: int, main_addr: str,
              main_port: int = DEFAULT_PORT, config: str = "pipelines.yaml", sets: list[str] | None = None
              ) -> list[tuple[dict[str, Any], str | None]]:
    """``(parameters, work queue)`` of each node's flow run: node 0 on :data:`HEAD_QUEUE`, the others on
    the pool's default queue."""
    if nodes < 2:
        raise ValueError(f"a multi-node run needs at least 2 nodes, got {nodes}")
    base = {"pipeline": pipeline, "quick": quick, "arm": arm, "seed": seed, "main_addr": main_addr,
            "main_port": main_port, "config": config, "sets": [*(sets or ()), f"execution.nodes={nodes}"]}
    return [({**base, "node_rank": rank}, HEAD_QUEUE if rank == 0 else None) for rank in range(nodes)]


def start_nodes(deployment: str, pipeline: str, quick: bool, arm: str, seed: int, nodes: int, main_addr: str,
                main_port: int = DEFAULT_PORT, config: str = "pipelines.yaml", sets: list[str] | None = None
                ) -> list[Any]:
    """Start one flow run of ``deployment`` (``train-node/<name>``) per node and wait for all of them;
    returns their final flow runs (node 0's holds the run's result)."""
    from prefect.deployments import run_deployment

    started = [run_deployment(deployment, parameters=params, work_queue_name=queue, timeout=0)
               for params, queue in node_runs(pipeline, quick, arm, seed, nodes, main_addr, main_port, config, sets)]
    return _wait([run.id for run in started])


def _wait(ids: list[Any], poll_s: float = 5.0) -> list[Any]:
    """The flow runs ``ids`` once every one of them is in a final state."""
    import time

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        while True:
            runs = [client.read_flow_run(i) for i in ids]
            if all(r.state is not None and r.state.is_final() for r in runs):
                return runs
            time.sleep(poll_s)
