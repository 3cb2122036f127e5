"""Optional push of each run's final model to the Hugging Face Hub (trainer.push_to_hub): skipped with
one line when no token exists, uploaded (create repo + upload folder) when one does. No network: the
Hub client is replaced by a recorder."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from vpo.pipeline import hub
from vpo.pipeline.config import ConfigError, load_pipeline
from vpo.pipeline.errors import StageError
from vpo.pipeline.layout import RunLayout, arm_runs

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp_path: Path, **trainer: Any) -> Any:
    raw = yaml.safe_load((ROOT / "pipelines.yaml").read_text())
    raw["pipelines"]["route"]["trainer"].update(trainer)
    path = tmp_path / "pipelines.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_pipeline("route", path, quick=True)


class _FakeApi:
    calls: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def __init__(self, token: str | None = None) -> None:
        self.token = token

    def create_repo(self, repo_id: str, **kw: Any) -> None:
        self.calls.append(("create_repo", {"repo_id": repo_id, "token": self.token, **kw}))

    def upload_folder(self, **kw: Any) -> None:
        self.calls.append(("upload_folder", kw))


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> type[_FakeApi]:
    import huggingface_hub

    _FakeApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeApi)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token saved by `hf auth login` here
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    return _FakeApi


def test_push_needs_a_hub_model_id(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="push_to_hub needs hub_model_id"):
        _cfg(tmp_path, push_to_hub=True)
    with pytest.raises(ConfigError, match="not a Hub repo id"):
        _cfg(tmp_path, push_to_hub=True, hub_model_id="no-namespace")


def test_without_a_token_nothing_is_uploaded_and_one_line_says_so(
    tmp_path: Path, fake_hub: type[_FakeApi], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path, push_to_hub=True, hub_model_id="me/vpo-route")
    assert hub.push_runs(cfg, RunLayout.of(cfg), arm_runs(cfg), ["h"] * 3) == []
    assert fake_hub.calls == []
    out = capsys.readouterr().out
    assert "[vpo] push_to_hub: no Hugging Face token (set HF_TOKEN or run `hf auth login`); skipped uploading " \
        f"{len(arm_runs(cfg))} run(s)" in out


def test_with_a_token_every_run_goes_to_its_own_repo(
    tmp_path: Path, fake_hub: type[_FakeApi], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_tests")
    cfg = _cfg(tmp_path, push_to_hub=True, hub_model_id="me/vpo-route", hub_private_repo=False)
    layout = RunLayout.of(cfg)
    runs = arm_runs(cfg)
    repos = hub.push_runs(cfg, layout, runs, [c * 64 for c in "abcdefgh"[: len(runs)]])
    assert repos == [f"me/vpo-route-{r.rid}" for r in runs] and "me/vpo-route-vpo-s0" in repos
    creates = [kw for name, kw in fake_hub.calls if name == "create_repo"]
    uploads = [kw for name, kw in fake_hub.calls if name == "upload_folder"]
    assert [c["repo_id"] for c in creates] == repos and all(c["private"] is False for c in creates)
    assert all(c["token"] == "hf_fake_token_for_tests" for c in creates)
    assert [u["folder_path"] for u in uploads] == [str(layout.arm_model(r.rid)) for r in arm_runs(cfg)]
    assert "registry hash bbbbbbbbbbbb" in uploads[1]["commit_message"]
    assert hub.push_runs(_cfg(tmp_path), layout, runs, ["x"] * len(runs)) == []  # off by default


def test_a_failed_upload_is_one_error_naming_the_repo(
    tmp_path: Path, fake_hub: type[_FakeApi], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_fake")

    def refuse(self: Any, **kw: Any) -> None:
        raise PermissionError("403 Forbidden: you cannot write to me/vpo-route-grpo-s0")

    monkeypatch.setattr(fake_hub, "upload_folder", refuse)
    cfg = _cfg(tmp_path, push_to_hub=True, hub_model_id="me/vpo-route")
    with pytest.raises(StageError, match=r"uploading grpo-s0 to me/vpo-route-grpo-s0 failed \(PermissionError: 403"):
        hub.push_runs(cfg, RunLayout.of(cfg), arm_runs(cfg), ["h"] * 3)
