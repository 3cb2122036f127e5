"""The shape we keep: the library (vpo/ outside vpo/pipeline) imports neither the pipeline layer nor
Prefect, DVC or flows; flows/ is the only Prefect code; no module imports lead in a circle (imports
inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module name an ``import`` / ``from ... import`` in the file names (relative ones resolved),
    except those under ``if TYPE_CHECKING:`` (annotations only: never imported when the code runs)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module(path) if path.name == "__init__.py" else _module(path).rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _sources() -> dict[str, Path]:
    files = [*(REPO / "vpo").rglob("*.py"), *(REPO / "flows").glob("*.py")]
    return {_module(p): p for p in files if "__pycache__" not in p.parts}


def test_library_imports_no_pipeline_prefect_dvc_or_flows() -> None:
    bad = {}
    for name, path in _sources().items():
        if not name.startswith("vpo.") or name.startswith("vpo.pipeline"):
            continue
        hits = sorted(i for i in _imports(path) if i.split(".")[0] in ("prefect", "dvc", "dvclive", "flows")
                      or i.startswith("vpo.pipeline"))
        if hits:
            bad[name] = hits
    assert bad == {}, f"library modules reaching into the pipeline or orchestration: {bad}"


def test_only_flows_import_prefect() -> None:
    users = sorted(n for n, p in _sources().items() if any(i.split(".")[0] == "prefect" for i in _imports(p)))
    assert users and all(n.startswith("flows.") for n in users), users


def test_no_import_cycles() -> None:
    sources = _sources()
    graph = {name: {i for i in _imports(path) if i in sources and i != name} for name, path in sources.items()}
    graph = {n: {d for d in deps if not (n.startswith(d + ".") and sources[d].name == "__init__.py")}
             for n, deps in graph.items()}  # a module importing its own package's __init__ is no cycle
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name)
            assert cycle is None, " -> ".join(cycle)


def test_nothing_under_vpo_imports_flows_or_prefect() -> None:
    """The pipeline layer included: `vpo flow|ui|serve` come from flows/cli.py through the
    `vpo.commands` entry point group, so no module under vpo/ names flows or prefect in an import."""
    bad = {name: sorted(i for i in _imports(path) if i.split(".")[0] in ("flows", "prefect"))
           for name, path in _sources().items() if name.split(".")[0] == "vpo"}
    assert {n: hits for n, hits in bad.items() if hits} == {}


def test_the_prefect_commands_join_vpo_through_the_entry_point_group() -> None:
    """The installed metadata registers flows.cli's commands under the group vpo/pipeline/cli.py reads
    (a dynamic lookup, not an import), and they parse as the same `vpo flow|ui|serve` commands."""
    from importlib.metadata import entry_points

    from vpo.pipeline import cli

    eps = {ep.name: ep.value for ep in entry_points(group=cli.COMMAND_GROUP)}
    assert eps.get("prefect") == "flows.cli:register", eps
    parser, handlers = cli._parser_and_handlers()
    assert {"flow", "ui", "serve"} <= set(handlers)
    args = parser.parse_args(["flow", "--quick", "--arms-on", "train-arm/x"])
    assert args.cmd == "flow" and args.quick and args.arms_on == "train-arm/x"
    assert parser.parse_args(["serve", "--cron", "0 1 * * *"]).cron == "0 1 * * *"
    assert parser.parse_args(["ui", "--keep"]).keep is True


PIPELINE_WINGS: tuple[tuple[str, ...], ...] = (
    ("vpo.pipeline.config",),
    ("vpo.pipeline.engine",),
    ("vpo.pipeline.registry", "vpo.pipeline.memory", "vpo.pipeline.validation"),
    ("vpo.pipeline.stages",),
    ("vpo.pipeline.steps",),
    ("vpo.pipeline.dvc",),
    ("vpo.pipeline.runner",),
    ("vpo.pipeline.cli",),
)
"""The pipeline's wings, lowest first: configuration, the engine that runs a stage, the parts stages use,
the stages, the stage table, DVC generation and recording, the runner, the command line."""


def _wing(module: str) -> int | None:
    for rank, prefixes in enumerate(PIPELINE_WINGS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def test_every_pipeline_module_has_a_wing_and_imports_no_higher_one() -> None:
    """vpo/pipeline in wings: each module belongs to one, and imports (inside functions too) only its own
    wing and the ones below it."""
    sources = _sources()
    pipeline = {n: p for n, p in sources.items() if n.startswith("vpo.pipeline.")}
    assert not [n for n in pipeline if _wing(n) is None], "modules outside every wing"
    upward = sorted(f"{name} -> {dep}" for name, path in pipeline.items() for dep in _imports(path)
                    if dep in sources and _wing(dep) is not None and _wing(dep) > _wing(name))
    assert upward == []
