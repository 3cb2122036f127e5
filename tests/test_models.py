"""Model sources: hub ids and local folders resolved one way; GGUF files located and imported once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from vpo.models import GGUF_IMPORT_FILE, ModelImportError, gguf_source, import_gguf, resolve_model


def _model_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_resolve_model_local_relative_to_base_and_hub_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg_dir = tmp_path / "configs"
    folder = _model_folder(cfg_dir / "models" / "m")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the working directory does not matter, only base_dir
    assert resolve_model("models/m", cfg_dir) == str(folder.resolve())
    assert resolve_model("./models/m", cfg_dir) == str(folder.resolve())
    assert resolve_model(str(folder), "/nonexistent") == str(folder.resolve())
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", cfg_dir) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model("gpt2") == "gpt2"
    with pytest.raises(ModelImportError, match="does not exist"):
        resolve_model("./models/missing", cfg_dir)
    (cfg_dir / "empty").mkdir()
    with pytest.raises(ModelImportError, match="no config.json"):
        resolve_model("empty", cfg_dir)
    with pytest.raises(ModelImportError, match="URL"):
        resolve_model("https://huggingface.co/gpt2")
    with pytest.raises(ModelImportError, match="hub id"):
        resolve_model("not a valid id")
    with pytest.raises(ModelImportError, match="empty"):
        resolve_model("  ")


def test_gguf_source_errors_name_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "site" / "fake_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.Q4.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    src = gguf_source(package="fake_gguf_pkg", file="model.Q4.gguf")
    assert src.path == (pkg / "model.Q4.gguf").resolve() and src.label == "package:fake_gguf_pkg/model.Q4.gguf"
    with pytest.raises(ModelImportError, match=r"no file 'other.gguf'.*model\.Q4\.gguf"):
        gguf_source(package="fake_gguf_pkg", file="other.gguf")
    with pytest.raises(ModelImportError, match="'no_such_pkg_xyz' is not installed"):
        gguf_source(package="no_such_pkg_xyz", file="x.gguf")
    with pytest.raises(ModelImportError, match="file name"):
        gguf_source(package="fake_gguf_pkg")
    assert gguf_source(pkg / "model.Q4.gguf").path == src.path
    assert gguf_source(pkg, file="model.Q4.gguf").path == src.path
    with pytest.raises(ModelImportError, match=r"is a folder.*model\.Q4\.gguf"):
        gguf_source(pkg)
    with pytest.raises(ModelImportError, match="does not exist"):
        gguf_source(tmp_path / "nope.gguf")
    with pytest.raises(ModelImportError, match="exactly one"):
        gguf_source(pkg / "model.Q4.gguf", package="fake_gguf_pkg", file="model.Q4.gguf")


def test_import_is_cached_and_needs_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF" + b"\0" * 8)
    out = _model_folder(tmp_path / "hf")
    fp = gguf_source(gguf_file).fingerprint()
    (out / GGUF_IMPORT_FILE).write_text(json.dumps({"fingerprint": fp, "dtype": "float32"}))
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the package were not installed
    # same file, same dtype: nothing is loaded (the fake file would not load)
    assert import_gguf(out, gguf_file) == out
    # another dtype or a changed file: a real import is needed, and it names the missing package
    with pytest.raises(ModelImportError, match="needs the 'gguf' package"):
        import_gguf(out, gguf_file, dtype="bfloat16")
    gguf_file.write_bytes(b"GGUF" + b"\0" * 16)
    with pytest.raises(ModelImportError, match="pip install 'vpo\\[chat\\]'"):
        import_gguf(out, gguf_file)
    with pytest.raises(ModelImportError, match="dtype"):
        import_gguf(out, gguf_file, dtype="int8")
