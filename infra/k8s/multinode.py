"""Render one multi-node training run for Kubernetes: a headless Service and an indexed Job, one pod per node.

    .venv/bin/python infra/k8s/multinode.py --nodes 2 --gpus 8 --arm vpo --seed 0 \\
        --pipeline code-qwen-coder --image registry/vpo:gpu --checkpoints s3://bucket/checkpoints > run.yaml
    kubectl apply -f run.yaml

Every pod runs the same ``vpo stage train`` (:func:`vpo.pipeline.engine.nodes.node_argv`); the Job's
completion index is the node rank (``JOB_COMPLETION_INDEX``, read by the train stage), and node 0 is
reached at ``<job>-0.<service>`` (rendezvous port, and the next one for the nodes' heartbeat) through
the headless Service (``subdomain``), which publishes the pods
before they are ready so the rendezvous can resolve it. ``backoffLimit: 0``: a lost pod fails the Job
(the other pods' ranks fail with one line naming it); applying the Job again resumes the run from
``storage.checkpoints`` (S3), so nothing on a pod's disk is needed. S3 keys come from a Secret, never
from this file. The pods need the pipeline's inputs (data, rewards, base): the image's checkout with
``dvc pull`` in its entrypoint, or a shared volume at the run folder.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from vpo.pipeline.engine.nodes import DEFAULT_PORT, MAIN_ADDR_ENV, MAIN_PORT_ENV, node_argv

__all__ = ["main", "render"]


def render(*, nodes: int, gpus: int, arm: str, seed: int, pipeline: str, image: str, name: str = "vpo-train",
           namespace: str = "vpo", accelerate_config: str = "infra/accelerate/deepspeed_zero2.yaml",
           checkpoints: str | None = None, secret: str = "vpo-s3", port: int = DEFAULT_PORT,
           memory: str = "480Gi", shm: str = "64Gi", cpu: str = "64", sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The Service and the Job of one run over ``nodes`` pods of ``gpus`` GPUs each."""
    if nodes < 2:
        raise ValueError(f"--nodes must be at least 2 (one node needs no rendezvous), got {nodes}")
    job = f"{name}-{arm}-s{seed}"
    labels = {"app.kubernetes.io/name": "vpo", "vpo/run": f"{arm}-s{seed}", "vpo/job": job}
    settings = [f"execution.nodes={nodes}", f"trainer.accelerate_config={accelerate_config}",
                *([f"storage.checkpoints={checkpoints}"] if checkpoints else []), *sets]
    command = ["python", "-m", "vpo.pipeline.cli", *node_argv(arm, seed, pipeline=pipeline, sets=settings)]
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": job, "namespace": namespace, "labels": labels},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"vpo/job": job},
                 "ports": [{"name": "rendezvous", "port": port, "targetPort": port},
                           {"name": "heartbeat", "port": port + 1, "targetPort": port + 1}]},
    }
    pod = {
        "metadata": {"labels": dict(labels)},
        "spec": {
            "subdomain": job, "restartPolicy": "Never",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{
                "name": "node", "image": image, "command": command,
                "env": [{"name": MAIN_ADDR_ENV, "value": f"{job}-0.{job}"},
                        {"name": MAIN_PORT_ENV, "value": str(port)},
                        {"name": "PYTHONUNBUFFERED", "value": "1"}],
                "envFrom": [{"secretRef": {"name": secret, "optional": False}}],
                "ports": [{"name": "rendezvous", "containerPort": port},
                          {"name": "heartbeat", "containerPort": port + 1}],
                "resources": {"requests": {"cpu": cpu, "memory": memory, "nvidia.com/gpu": gpus},
                              "limits": {"memory": memory, "nvidia.com/gpu": gpus}},
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
            }],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}],
        },
    }
    job_doc = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": job, "namespace": namespace, "labels": dict(labels)},
        "spec": {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes, "backoffLimit": 0,
                 "template": pod},
    }
    return [service, job_doc]


def main(argv: list[str] | None = None) -> int:
    """Print the rendered manifests (YAML documents) for ``kubectl apply -f -``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus", type=int, required=True, help="GPUs per node (the accelerate config's processes)")
    ap.add_argument("--arm", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pipeline", required=True)
    ap.add_argument("--image", required=True)
    ap.add_argument("--name", default="vpo-train")
    ap.add_argument("--namespace", default="vpo")
    ap.add_argument("--accelerate-config", default="infra/accelerate/deepspeed_zero2.yaml")
    ap.add_argument("--checkpoints", help="storage.checkpoints: where checkpoints are mirrored (s3://...)")
    ap.add_argument("--secret", default="vpo-s3", help="Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--memory", default="480Gi", help="memory request and limit of each pod")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    opts = ap.parse_args(argv)
    docs = render(nodes=opts.nodes, gpus=opts.gpus, arm=opts.arm, seed=opts.seed, pipeline=opts.pipeline,
                  image=opts.image, name=opts.name, namespace=opts.namespace,
                  accelerate_config=opts.accelerate_config, checkpoints=opts.checkpoints, secret=opts.secret,
                  port=opts.port, memory=opts.memory, sets=tuple(opts.sets))
    sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
