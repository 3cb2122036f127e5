"""The work-pool side of a multi-node run (flows/nodes.py): one flow run of the ``train-node`` deployment
per node, node 0's on the head machine's queue, each running the same `vpo stage train` with its rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def test_one_flow_run_per_node_with_node_0_on_the_head_queue() -> None:
    from flows.nodes import HEAD_QUEUE, node_runs, train_node

    runs = node_runs("route", True, "vpo", 0, 3, "10.0.0.5", 29600, sets=["trainer.max_steps=2"])
    assert [queue for _, queue in runs] == [HEAD_QUEUE, None, None]
    assert [params["node_rank"] for params, _ in runs] == [0, 1, 2]
    assert all(params["sets"] == ["trainer.max_steps=2", "execution.nodes=3"] and params["main_addr"] == "10.0.0.5"
               for params, _ in runs)
    accepted = set(train_node.parameters.properties)  # the deployment's entrypoint takes exactly these
    assert set(runs[0][0]) <= accepted
    with pytest.raises(ValueError, match="at least 2 nodes"):
        node_runs("route", True, "vpo", 0, 1, "10.0.0.5")


def test_prefect_yaml_deploys_the_node_flow() -> None:
    deployments = {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    node = deployments["train-node-process"]
    assert node["entrypoint"] == "flows/nodes.py:train_node" and node["work_pool"]["name"] == "vpo-process"


def test_each_node_runs_the_same_command_told_apart_by_its_environment() -> None:
    from vpo.pipeline.engine.nodes import node_argv, node_env

    argv = node_argv("vpo", 1, pipeline="route", quick=True, sets=["execution.nodes=2"])
    assert argv == ["stage", "train", "--config", "pipelines.yaml", "--pipeline", "route", "--quick", "--arm", "vpo",
                    "--seed", "1", "--set", "execution.nodes=2"]
    assert node_env(1, "10.0.0.5", 29600) == {"VPO_NODE_RANK": "1", "VPO_MAIN_ADDR": "10.0.0.5",
                                              "VPO_MAIN_PORT": "29600"}
