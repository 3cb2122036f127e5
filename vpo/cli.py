"""The ``vpo`` command: the main job, single stages (what dvc.yaml calls), the Prefect UI and cron.

    vpo run [--pipeline P] [--quick]             all stages in this process, final table printed
    vpo stage NAME [--pipeline P] [--quick] [--arm A --seed S]
    vpo flow [--pipeline P] [--quick]            the Prefect retrain flow (ephemeral server)
    vpo ui [--pipeline P] [--quick]              start a local Prefect server, run the flow against it
    vpo serve [--pipeline P] [--cron "0 3 * * *"]  cron deployment (flow.serve)
    vpo pipelines                                list the pipelines in pipelines.yaml

Exit codes: 0 done; 2 bad input (config, data, reward, checkpoint: one ``error:`` line naming the
file/row/key and what was expected); 3 the run folder is locked by another run (``vpo run`` and
``vpo stage`` hold ``runs/<pipeline>/.lock``, see :mod:`vpo.locking`); other codes are crashes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

_ENV_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    "DVC_NO_ANALYTICS": "1",
    "GX_ANALYTICS_ENABLED": "False",
    "TOKENIZERS_PARALLELISM": "false",
}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline", "-p", default=None, help="pipeline name in pipelines.yaml (default: its `default`)")
    p.add_argument("--config", default="pipelines.yaml", help="path of pipelines.yaml")
    p.add_argument("--quick", action="store_true", help="apply the pipeline's `quick:` preset (tests, smoke runs)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set trainer.steps=10 (value parsed as JSON/YAML)")


def _overrides(items: Sequence[str]) -> dict[str, object]:
    import yaml

    out: dict[str, object] = {}
    for item in items:
        if "=" not in item:
            print(f"error: --set expects KEY=VALUE, got {item!r}", file=sys.stderr)
            raise SystemExit(2)
        key, value = item.split("=", 1)
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            print(f"error: --set {key.strip()}: value {value!r} is not valid YAML ({exc})", file=sys.stderr)
            raise SystemExit(2) from None
    return out


def _load(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from vpo.config import ConfigError, load_pipeline

    try:
        return load_pipeline(args.pipeline, args.config, quick=args.quick, overrides=_overrides(args.set))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: Sequence[str] | None = None) -> int:
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    ap = argparse.ArgumentParser(prog="vpo", description="Vector Policy Optimization pipeline")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="run every stage of a pipeline in this process (the main job)")
    _common(p_run)
    p_run.add_argument("--no-search", action="store_true",
                       help="skip the search stage (it runs when the pipeline has an enabled `search:`)")
    p_stage = sub.add_parser("stage", help="run one stage (what dvc.yaml calls)")
    p_stage.add_argument("name", help="data | rewards | base | train | evaluate | register | search")
    _common(p_stage)
    p_stage.add_argument("--arm", default=None, help="train: only this arm")
    p_stage.add_argument("--seed", type=int, default=None, help="train: only this seed")
    for name, helptext in (("flow", "run the Prefect retrain flow"),
                           ("ui", "start a local Prefect server and run the flow against it"),
                           ("serve", "serve the retrain flow as a cron deployment")):
        p = sub.add_parser(name, help=helptext)
        _common(p)
        if name == "serve":
            p.add_argument("--cron", default="0 3 * * *", help="cron schedule (UTC)")
            p.add_argument("--name", default="nightly", help="deployment name")
        if name == "ui":
            p.add_argument("--port", type=int, default=4200)
            p.add_argument("--keep", action="store_true", help="keep the server running after the flow")
    sub.add_parser("pipelines", help="list pipelines").add_argument("--config", default="pipelines.yaml")
    args = ap.parse_args(argv)

    if args.cmd == "pipelines":
        from vpo.config import load_all

        for name, cfg in load_all(args.config).items():
            print(f"{name}: {cfg.description.strip()}")
        return 0
    cfg = _load(args)
    from vpo.locking import LockBusyError, pipeline_lock
    from vpo.registry import RegistryError
    from vpo.rewards import RewardError
    from vpo.stages import STAGES, StageError, run_all, run_dir
    from vpo.storage import redact
    from vpo.validation import ValidationError

    try:
        if args.cmd == "run":
            stages = ["data", "rewards", "base", "train", "evaluate", "register"] + (
                ["search"] if cfg.search is not None and cfg.search.enabled and not args.no_search else [])
            run_all(cfg, stages=stages)
            table = (run_dir(cfg) / "eval" / "table.md").read_text()
            print("\n" + table)
            if "search" in stages:
                print((run_dir(cfg) / "search" / "table.md").read_text())
                print(f"search plot: {run_dir(cfg) / 'search' / 'curves.png'}")
            print(f"plot: {run_dir(cfg) / 'eval' / 'best_at_k.png'}")
            return 0
        if args.cmd == "stage":
            if args.name not in STAGES:
                print(f"error: unknown stage {args.name!r}; stages: {', '.join(STAGES)}", file=sys.stderr)
                return 2
            kwargs = {"arm_name": args.arm, "seed": args.seed} if args.name == "train" else {}
            # one arm+seed trains beside other arms (shared run lock); anything else runs alone
            arm = f"{args.arm}-s{args.seed}" if args.name == "train" and args.arm and args.seed is not None else None
            with pipeline_lock(run_dir(cfg), run_dir(cfg).name, arm=arm):
                result = STAGES[args.name](cfg, **kwargs)
            print(json.dumps({"stage": args.name, "ok": True, "keys": sorted(result)}, default=str))
            return 0
    except LockBusyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except (StageError, RewardError, RegistryError, ValidationError) as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 2
    from flows import retrain as flows

    if args.cmd == "flow":
        flows.retrain(pipeline=cfg.name, quick=args.quick, config=args.config)
    elif args.cmd == "ui":
        flows.run_with_local_server(pipeline=cfg.name, quick=args.quick, config=args.config, port=args.port,
                                    keep=args.keep)
    elif args.cmd == "serve":
        flows.serve(pipeline=cfg.name, quick=args.quick, config=args.config, cron=args.cron, name=args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
