"""``vpo registry list|show|best|fetch|promote|verify|migrate``.

The registry is ``--registry URL``, else ``$VPO_REGISTRY``, else the default pipeline's
``storage.registry``; the project (git tags, DVC) is ``--repo``, else the git work tree holding the
current folder. Exit 0 on success, 1 when verification or storage fails, 2 for bad input; every
error is one line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from vpo.pipeline.engine.console import command
from vpo.pipeline.engine.storage import StorageError, configure_dvc_remote, redact
from vpo.pipeline.registry import DEFAULT_METRIC, Entry, Registry, RegistryError, RegistryInputError
from vpo.pipeline.registry.entries import best, latest, metric_value, select, settings_that_differ

__all__ = ["main"]

_KEY = "hash prefix, <name>@latest|best|<stage>, <artifact>@v1.2.3 or a stage"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage and one "error:" line, exit 2
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {message}\n")


def _parser(prog: str) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--registry", default=argparse.SUPPRESS, help="folder or s3://bucket/prefix")
    common.add_argument("--repo", default=argparse.SUPPRESS, help="the project's git/DVC repository")
    p = _Parser(prog=prog, parents=[common], description="Registered models: DVC artifacts with GTO versions and "
                "stages, and their entries (metrics, lineage, model card).")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    for cmd, text in (("list", "entries: version, stages, metrics, the settings that differ"),
                      ("best", "the entry with the highest value of a metric")):
        s = sub.add_parser(cmd, parents=[common], help=text)
        s.add_argument("--name", help="variant or artifact (glob allowed: 'route*')")
        s.add_argument("--arm", help="arm run (glob allowed: 'vpo-*')")
        s.add_argument("--json", action="store_true", help="JSON, one object per entry")
    s.add_argument("--metric", default=DEFAULT_METRIC, help=f"dotted key into the metrics (default {DEFAULT_METRIC})")
    s.add_argument("--lower-is-better", action="store_true")
    s = sub.add_parser("show", parents=[common], help="one entry as JSON, or its model card")
    s.add_argument("key", help=_KEY)
    s.add_argument("--card", action="store_true", help="print the model card")
    s = sub.add_parser("fetch", parents=[common], help="get a model through DVC, every file checked")
    s.add_argument("key", help=_KEY)
    s.add_argument("dest", help="destination folder")
    s.add_argument("--overwrite", action="store_true", help="replace a destination holding other content")
    s = sub.add_parser("promote", parents=[common], help="assign a stage (a GTO tag), e.g. production")
    s.add_argument("key", help=_KEY)
    s.add_argument("stage_pos", nargs="?", metavar="STAGE")
    s.add_argument("--stage", help="the stage (or give it after the key)")
    s.add_argument("--remove", action="store_true", help="take the entry out of the stage")
    sub.add_parser("verify", parents=[common], help="fetch through DVC and re-hash (default: every entry)"
                   ).add_argument("keys", nargs="*", help=_KEY)
    sub.add_parser("migrate", parents=[common], help="move an older registry (objects/, aliases/) to this layout")
    return p


def _rows(entries: list[Entry], stages: dict[tuple[str, str], list[str]]) -> list[dict[str, Any]]:
    """One table row per entry: version, stages (with ``latest`` / ``best`` of its name), headline
    metrics and the settings that differ from the other entries of its name."""
    marks = {(e.artifact, e.hash): [] for e in entries}
    for name in {e.name for e in entries}:
        group = [e for e in entries if e.name == name]
        marks[(latest(group).artifact, latest(group).hash)].append("latest")
        with contextlib.suppress(RegistryError):
            marks[(best(group)[0].artifact, best(group)[0].hash)].append("best")
    differ, rows = settings_that_differ(entries), []
    for e in entries:
        key, kmax = (e.artifact, e.hash), metric_value(e, "eval.best_at_k.kmax")
        ks = [int(k) for k in (e.metrics.get("eval") or {}).get("best_at_k", {}) if str(k).isdigit()]
        version = (e.version or "-") + (" (tag only)" if e.tag_only else "")
        rows.append({"artifact": e.artifact, "hash": e.hash[:12], "version": version,
                     "trained": e.trained_at[:19].replace("T", " "), "best@1": metric_value(e, "eval.best_at_k.1"),
                     "best@kmax": f"{kmax:.4g} (k={max(ks)})" if kmax is not None else None,
                     "diversity": metric_value(e, "eval.reward_diversity"),
                     "stages": ",".join(marks[key] + sorted(stages.get(key, []))) or "-",
                     "settings": " ".join(differ[key][:4]) + (f" +{len(differ[key]) - 4}" if len(differ[key]) > 4 else "")})
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    cells = [[str(c) for c in rows[0]]] + [["–" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) or "-"
                                          for v in r.values()] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells)


def _ensure_remote(reg: Registry, remote: tuple[str, str] | None) -> None:
    """Fetching needs a DVC remote: set the pipeline's ``storage.dvc_remote`` when the repo has none."""
    if remote is None or not (reg.dvc_repo / ".dvc").is_dir():
        return
    from dvc.repo import Repo

    with Repo(str(reg.dvc_repo)) as repo:
        if repo.config.get("core", {}).get("remote") or repo.config.get("remote"):
            return
    with contextlib.suppress(StorageError):
        configure_dvc_remote(reg.dvc_repo, remote[0], name=remote[1])


def _missing(reg: Registry, source: str, entries: list[Entry]) -> RegistryInputError:
    """The error for a registry URL with nothing behind it (mistyped, or never written to)."""
    tagged = sum(e.tag_only for e in entries)
    tags = (f"; the repository's git tags record {tagged} model versions, which `{command('registry', 'fetch')} "
            "<artifact>@<version> DEST` gets without a registry" if tagged else "")
    return RegistryInputError(f"registry {redact(reg.store.url)} ({source}) does not exist: nothing is at that "
                              f"path; check the URL{tags}")


def _chosen(entries: list[Entry], name: str | None, arm: str | None) -> list[Entry]:
    """The entries ``--name`` and ``--arm`` select; one error naming the filter that matched nothing."""
    pool = select(entries, name, arm)
    if pool or (name is None and arm is None):
        return pool
    if name is not None and not select(entries, name):
        known = sorted({e.name for e in entries}) + sorted({e.artifact for e in entries})
        raise RegistryInputError(f"--name {name!r} matches no entry (variants and artifacts: "
                                 f"{', '.join(known[:12]) or 'none'}; globs allowed: 'route*')")
    arms = sorted({e.arm for e in select(entries, name) if e.arm})
    raise RegistryInputError(f"--arm {arm!r} matches no entry" + (f" named {name!r}" if name else "")
                             + f" (arm runs: {', '.join(arms) or 'none'}; globs allowed: 'vpo-*')")


def _run(args: argparse.Namespace, reg: Registry, remote: tuple[str, str] | None, source: str) -> int:
    if args.cmd == "migrate":
        print("\n".join(reg.store.migrate()) or f"nothing to migrate in {redact(reg.store.url)}")
    elif args.cmd == "promote":
        if not (stage := args.stage or args.stage_pos) or args.stage and args.stage_pos and args.stage != args.stage_pos:
            raise RegistryInputError("promote: give one stage, e.g. `promote route-quick-vpo-s0 --stage production`")
        print(reg.promote(args.key, stage, remove=args.remove))
    elif args.cmd == "fetch":
        entry = reg.get(args.key)
        _ensure_remote(reg, remote)
        dest, how = reg.fetch(entry, args.dest, overwrite=args.overwrite)
        print(f"{dest}  ({entry.label}, {len(entry.files) or 'all'} files checked, from {how})")
    elif args.cmd == "show":
        entry = reg.get(args.key)
        if args.card:
            print(reg.card(entry), end="")
        else:
            stages = reg.scan()[1].get((entry.artifact, entry.hash), [])
            print(json.dumps({**entry.to_dict(), "stages": stages}, indent=2, sort_keys=True, default=str))
    else:
        entries, stages, bad = reg.scan()
        if not reg.store.exists():
            raise _missing(reg, source, entries)
        for line in bad:
            print(f"warning: {redact(line)}", file=sys.stderr)
        if args.cmd == "verify":
            _ensure_remote(reg, remote)
            for path in reg.store.clean_temps():
                print(f"removed {path} (left by a killed registration)")
            chosen, failed = [reg.get(k) for k in args.keys] if args.keys else entries, 0
            for e in chosen:
                problems = reg.verify(e)
                failed += bool(problems)
                how = "its git tag's content hash (no registry entry)" if e.tag_only else "every file re-hashed"
                print(f"FAIL {e.label}: {'; '.join(problems)}" if problems else f"ok   {e.label}: {how}")
            tagged = sum(e.tag_only for e in chosen)
            print(f"{len(chosen) - failed}/{len(chosen)} entries verified"
                  + (f" ({tagged} of them from git tags only: {redact(reg.store.url)} has no entry for them)"
                     if tagged else "") + (f"; {len(bad)} unreadable" if bad else ""))
            return 1 if failed or bad else 0
        pool = _chosen(entries, args.name, args.arm)
        if args.cmd == "best":
            e, value = best(pool, args.metric, lower_is_better=args.lower_is_better)
            print(json.dumps({"artifact": e.artifact, "hash": e.hash, "metric": args.metric, "value": value})
                  if args.json else f"{e.artifact}  {e.hash[:12]}  {args.metric}={value:.6g}  (full hash {e.hash})")
        elif args.json:
            for row, e in zip(_rows(pool, stages), pool):
                print(json.dumps({**row, "hash": e.hash, "name": e.name, "arm": e.arm}))
        else:
            print(_table(_rows(pool, stages)) if pool else f"no entries in {redact(reg.store.url)}")
            if tagged := sum(e.tag_only for e in pool):
                print(f"note: {tagged} of these come from the repository's GTO tags only: {redact(reg.store.url)} "
                      "has no entry for them (no metrics or card here)", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None, *, default_registry: str | None = None, prog: str = "vpo registry",
         default_remote: tuple[str, str] | None = None) -> int:
    """Run the registry CLI; returns the exit code."""
    parser = _parser(prog)
    try:
        args = parser.parse_args(argv)
        url, source = _url(parser, getattr(args, "registry", None), default_registry)
        return _run(args, Registry(url, getattr(args, "repo", None)), default_remote, source)
    except BrokenPipeError:  # piped into `head`
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except RegistryError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 2 if isinstance(exc, RegistryInputError) else 1
    except OSError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 1


def _url(parser: argparse.ArgumentParser, flag: str | None, default: str | None) -> tuple[str, str]:
    """The registry URL and where it came from: ``--registry``, ``$VPO_REGISTRY``, else the default
    pipeline's ``storage.registry``; an empty one given on purpose is an error, not the next one."""
    env = os.environ.get("VPO_REGISTRY")
    for value, source in ((flag, "--registry"), (env, "$VPO_REGISTRY")):
        if value is not None:
            if not value.strip():
                parser.error(f"{source} is empty: give a folder or s3://bucket/prefix")
            return value, source
    if not default:
        parser.error("no registry given: pass --registry URL (a folder or s3://bucket/prefix) or set VPO_REGISTRY")
    return str(default), "storage.registry of the default pipeline in pipelines.yaml"
