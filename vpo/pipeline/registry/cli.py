"""``vpo registry list|show|best|fetch|promote|verify|migrate``: the registry from the command line.

The registry is ``--registry URL``, else ``$VPO_REGISTRY``, else the default pipeline's
``storage.registry``; the project repository (git tags, dvc.yaml, DVC cache and remote) is ``--repo``,
else the git work tree holding the current folder. Exit 0 on success, 1 when verification or storage
fails, 2 for bad input (unknown key, bad metric or stage, no registry); every error is one line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from vpo.pipeline.registry import DEFAULT_METRIC, Entry, Registry, RegistryError, RegistryInputError
from vpo.pipeline.registry.entries import best, latest, metric_value, select, settings_that_differ
from vpo.pipeline.storage import StorageError, configure_dvc_remote, redact

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage + one "error:" line, exit 2
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {message}\n")


def _parser(prog: str) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--registry", default=argparse.SUPPRESS, help="a folder or s3://bucket/prefix (default: "
                        "$VPO_REGISTRY, else the default pipeline's storage.registry)")
    common.add_argument("--repo", default=argparse.SUPPRESS, help="the project's git/DVC repository (default: the "
                        "one holding the current folder)")
    p = _Parser(prog=prog, parents=[common], description="Registered models: DVC artifacts with GTO versions and "
                "stages, plus entries (metrics, lineage, model card) in the registry.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    s = sub.add_parser("list", parents=[common], help="entries: version, stages, metrics and the settings that differ")
    s.add_argument("--name", help="variant or artifact (glob allowed: 'route*')")
    s.add_argument("--arm", help="arm run (glob allowed: 'vpo-*')")
    s.add_argument("--json", action="store_true", help="one JSON object per entry")
    s = sub.add_parser("show", parents=[common], help="one entry as JSON, or its model card")
    s.add_argument("key", help="hash prefix, <name>@latest|best|<stage>, <artifact>@v1.2.3 or a stage")
    s.add_argument("--card", action="store_true", help="print the model card (README.md)")
    s = sub.add_parser("best", parents=[common], help="the entry with the highest value of a metric")
    s.add_argument("--metric", default=DEFAULT_METRIC, help=f"dotted key into the metrics (default {DEFAULT_METRIC})")
    s.add_argument("--lower-is-better", action="store_true")
    s.add_argument("--name")
    s.add_argument("--arm")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("fetch", parents=[common], help="get a model through DVC; every file checked against the entry")
    s.add_argument("key")
    s.add_argument("dest", help="destination folder")
    s.add_argument("--overwrite", action="store_true", help="replace a destination holding other content")
    s = sub.add_parser("promote", parents=[common], help="assign a stage (GTO tag), e.g. production")
    s.add_argument("key")
    s.add_argument("stage_pos", nargs="?", metavar="STAGE")
    s.add_argument("--stage", help="the stage (or give it after the key)")
    s.add_argument("--remove", action="store_true", help="take the entry out of the stage")
    s = sub.add_parser("verify", parents=[common], help="fetch through DVC and re-hash (all entries by default)")
    s.add_argument("keys", nargs="*")
    sub.add_parser("migrate", parents=[common], help="move an older registry's entries and aliases to this layout")
    return p


def _table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    cells = [["–" if r[c] is None else f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in [cols, *cells])


def _row(e: Entry, marks: list[str], differ: list[str]) -> dict[str, Any]:
    kmax = metric_value(e, "eval.best_at_k.kmax")
    ks = [int(k) for k in (e.metrics.get("eval") or {}).get("best_at_k", {}) if str(k).isdigit()]
    return {"artifact": e.artifact, "hash": e.hash[:12], "version": e.version or "-",
            "trained": e.trained_at[:19].replace("T", " "), "best@1": metric_value(e, "eval.best_at_k.1"),
            "best@kmax": f"{kmax:.4g} (k={max(ks)})" if kmax is not None else None,
            "diversity": metric_value(e, "eval.reward_diversity"), "stages": ",".join(marks) or "-",
            "settings": " ".join(differ[:4]) + (f" +{len(differ) - 4}" if len(differ) > 4 else "") or "-"}


def _marks(entries: list[Entry], stages: dict[tuple[str, str], list[str]]) -> dict[tuple[str, str], list[str]]:
    """Per entry: ``latest`` / ``best`` of its name (queries) and its stages (GTO or recorded)."""
    out = {(e.artifact, e.hash): [] for e in entries}
    for name in {e.name for e in entries}:
        group = [e for e in entries if e.name == name]
        out[(latest(group).artifact, latest(group).hash)].append("latest")
        with contextlib.suppress(RegistryError):
            top = best(group)[0]
            out[(top.artifact, top.hash)].append("best")
    for key, names in stages.items():
        if key in out:
            out[key] += sorted(names)
    return out


def _warn(lines: Sequence[str]) -> None:
    for line in lines:
        print(f"warning: {redact(line)}", file=sys.stderr)


def _ensure_remote(reg: Registry, remote: tuple[str, str] | None) -> None:
    """Fetching needs a DVC remote: configure the pipeline's ``storage.dvc_remote`` when none is set."""
    if remote is None or not (reg.dvc_repo / ".dvc").is_dir():
        return
    from dvc.repo import Repo

    with Repo(str(reg.dvc_repo)) as repo:
        if repo.config.get("core", {}).get("remote") or repo.config.get("remote"):
            return
    with contextlib.suppress(StorageError):
        configure_dvc_remote(reg.dvc_repo, remote[0], name=remote[1])


def _run(args: argparse.Namespace, reg: Registry, remote: tuple[str, str] | None) -> int:
    if args.cmd == "migrate":
        moved = reg.store.migrate()
        print("\n".join(moved) if moved else f"nothing to migrate in {redact(reg.store.url)}")
        return 0
    if args.cmd == "promote":
        stage = args.stage or args.stage_pos
        if not stage or (args.stage and args.stage_pos and args.stage != args.stage_pos):
            raise RegistryInputError("promote: give one stage, e.g. `promote route-quick-vpo-s0 --stage production`")
        print(reg.promote(args.key, stage, remove=args.remove))
        return 0
    if args.cmd in ("show", "fetch"):
        entry = reg.get(args.key)
        if args.cmd == "fetch":
            _ensure_remote(reg, remote)
            dest, how = reg.fetch(entry, args.dest, overwrite=args.overwrite)
            print(f"{dest}  ({entry.label}, {len(entry.files) or 'all'} files checked, from {how})")
        elif args.card:
            print(reg.card(entry), end="")
        else:
            _, stages, _ = reg.scan()
            print(json.dumps({**entry.to_dict(), "stages": stages.get((entry.artifact, entry.hash), [])},
                             indent=2, sort_keys=True, default=str))
        return 0
    entries, stages, bad = reg.scan()
    _warn(bad)
    if args.cmd == "verify":
        _ensure_remote(reg, remote)
        chosen = [reg.get(k) for k in args.keys] if args.keys else entries
        failed = 0
        for e in chosen:
            problems = reg.verify(e)
            failed += bool(problems)
            print(f"FAIL {e.label}: {'; '.join(problems)}" if problems else f"ok   {e.label}: {len(e.files) or 'all'} files re-hashed")
        print(f"{len(chosen) - failed}/{len(chosen)} entries verified" + (f"; {len(bad)} unreadable file(s)" if bad else ""))
        return 1 if failed or bad else 0
    pool = select(entries, args.name, args.arm)
    if args.cmd == "best":
        if not pool:
            raise RegistryInputError(f"no entries match in {redact(reg.store.url)}")
        e, value = best(pool, args.metric, lower_is_better=args.lower_is_better)
        print(json.dumps({**_row(e, [], []), "metric": args.metric, "value": value}) if args.json
              else f"{e.artifact}  {e.hash[:12]}  {args.metric}={value:.6g}  (full hash {e.hash})")
        return 0
    marks, differ = _marks(pool, stages), settings_that_differ(pool)
    rows = [_row(e, marks[(e.artifact, e.hash)], differ.get((e.artifact, e.hash), [])) for e in pool]
    if args.json:
        print("\n".join(json.dumps({**r, "hash": e.hash, "name": e.name, "arm": e.arm}) for r, e in zip(rows, pool)))
    else:
        print(_table(rows) if rows else f"no entries in {redact(reg.store.url)}")
    return 0


def main(argv: Sequence[str] | None = None, *, default_registry: str | None = None, prog: str = "vpo registry",
         default_remote: tuple[str, str] | None = None) -> int:
    """Run the registry CLI; returns the exit code."""
    parser = _parser(prog)
    try:
        args = parser.parse_args(argv)
        url = getattr(args, "registry", None) or os.environ.get("VPO_REGISTRY") or default_registry
        if not url:
            parser.error("no registry given: pass --registry URL (a folder or s3://bucket/prefix) or set VPO_REGISTRY")
        return _run(args, Registry(url, getattr(args, "repo", None)), default_remote)
    except BrokenPipeError:  # piped into `head`
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except RegistryInputError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except (RegistryError, OSError) as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main(prog="python -m vpo.pipeline.registry"))
