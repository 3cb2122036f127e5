"""What a non-editable install ships: every folder of Python modules under ``vpo/`` and ``flows/`` is a
package that setuptools' discovery (as ``pyproject.toml`` configures it) puts in the wheel, so a Docker
image or ``pip install .`` gets the whole pipeline, not only the modules an editable install finds."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "vpo" / "data"  # package data (problem sets and the script that builds them), not modules


def _module_folders() -> set[str]:
    folders = set()
    for top in ("vpo", "flows"):
        for module in (ROOT / top).rglob("*.py"):
            folder = module.parent
            if DATA in (folder, *folder.parents) or "__pycache__" in folder.parts:
                continue
            folders.add(".".join(folder.relative_to(ROOT).parts))
    return folders


def test_every_module_folder_is_a_package_the_wheel_ships() -> None:
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = set(find_packages(str(ROOT), include=find["include"]))
    folders = _module_folders()
    assert "vpo.pipeline.engine" in folders and "flows" in folders  # the walk sees the tree
    assert folders - shipped == set(), f"folders with modules a wheel would leave out: {sorted(folders - shipped)}"
