"""Model cards and the Hub: the card ``huggingface_hub.ModelCard.load`` reads back (base_model, eval
results, the settings each estimator uses, LoRA stated as it was), the README TRL writes into a
checkpoint naming VPO, and the optional push of each run's model folder (trainer.push_to_hub): skipped
with one line when no token exists, uploaded when one does. No network: the Hub client is a recorder."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from vpo.pipeline.config import ConfigError, load_pipeline
from vpo.pipeline.config.layout import RunLayout, arm_runs
from vpo.pipeline.engine.console import tool
from vpo.pipeline.engine.errors import StageError
from vpo.pipeline.registry import hub

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
    assert f"[vpo] push_to_hub: no Hugging Face token (set HF_TOKEN or run `{tool('hf', 'auth', 'login')}`); " \
        "skipped uploading " \
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
    assert "content hash bbbbbbbbbbbb" in uploads[1]["commit_message"]
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


# --------------------------------------------------------------------------- model cards


def _entry(tmp_path: Path, estimator: str, arm: str, *, train: dict[str, Any] | None = None,
           adapter: bool = False) -> tuple[Any, Path]:
    from tests.support.registry import make_checkpoint, metrics
    from vpo.pipeline.registry import Registry

    folder = make_checkpoint(tmp_path / arm)
    if adapter:
        (folder / "adapter_config.json").write_text('{"r": 8}')
    settings = {"trainer": {"num_weights": 8, "weight_alpha": 1.0, "weight_sampler": "dirichlet"},
                "evaluation": {"split": "test"},
                "arms": {arm: {"estimator": estimator, "num_answers": 3 if estimator == "vpo" else 1,
                               "num_generations": 4, "rollout_multiplier": 1, "max_at_k_k": None}}}
    entry, _ = Registry(tmp_path / "registry", tmp_path).register(
        folder, name="route-quick", arm=f"{arm}-s0", params=settings,
        metrics={**metrics({1: 0.5, 4: 0.75}), "train": {"max_steps": 4, **(train or {})}},
        lineage={"estimator": estimator, "arm_config": arm, "task": "route", "base_hash": "b" * 64, "seed": 0,
                 "base_model": None})
    return entry, folder


def test_card_reads_back_with_base_model_eval_results_and_the_estimators_own_settings(tmp_path: Path) -> None:
    from huggingface_hub import ModelCard

    vpo_entry, folder = _entry(tmp_path, "vpo", "vpo")
    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model == "b" * 64 and card.data.library_name == "transformers"
    assert {"vpo", "trl"} <= set(card.data.tags) and card.data.model_name == "route-quick-vpo-s0"
    results = {(r.metric_type, r.metric_name): r.metric_value for r in card.data.eval_results}
    assert results[("best_at_k", "best@4")] == 0.75 and results[("pass_at_k", "pass@1")] == 0.25
    assert card.data.to_dict()["vpo"]["content_hash"] == vpo_entry.hash
    assert "| K (weightings per prompt group) | 8 |" in card.text and "| num_answers (answers per rollout) | 3 |" in card.text
    max_card = ModelCard.load(_entry(tmp_path, "max_at_k", "max_at_k")[1] / "README.md")
    assert "max_at_k" in max_card.data.tags
    assert "K (weightings" not in max_card.text and "| k of max@k | 2 (default) |" in max_card.text
    grpo_card = ModelCard.load(_entry(tmp_path, "grpo", "grpo")[1] / "README.md").text
    assert "K (weightings" not in grpo_card and "| scale_rewards |" not in grpo_card  # not recorded: not shown


def test_every_estimator_names_the_settings_it_uses() -> None:
    from vpo.advantages import ESTIMATORS

    assert all(hub.estimator_uses(name) for name in ESTIMATORS), [n for n in ESTIMATORS if not hub.estimator_uses(n)]
    assert "num_weights" in hub.estimator_uses("vpo") and "num_weights" not in hub.estimator_uses("max_at_k")


def test_card_states_lora_merged_or_adapters_as_the_run_recorded(tmp_path: Path) -> None:
    from huggingface_hub import ModelCard

    lora = {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}
    merged = ModelCard.load(_entry(tmp_path / "m", "vpo", "vpo", train={"lora": lora, "merged": True})[1] / "README.md")
    assert "LoRA adapters (r=16, lora_alpha=32) were trained and **merged**" in merged.text
    assert "lora" in merged.data.tags and merged.data.library_name == "transformers"
    adapters = ModelCard.load(_entry(tmp_path / "a", "vpo", "vpo", train={"lora": lora, "merged": False},
                                     adapter=True)[1] / "README.md")
    assert "holds LoRA adapters (r=16, lora_alpha=32), not full weights" in adapters.text
    assert adapters.data.library_name == "peft"


def test_the_readme_trl_writes_into_a_checkpoint_names_vpo_and_the_estimator(tmp_path: Path) -> None:
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.trainers import LetterReward, config, tiny_model_dir, toy_dataset
    from vpo.trainer import VPOTrainer

    model_dir = tiny_model_dir(tmp_path)

    def trainer(estimator: str, **kw: Any) -> Any:
        return VPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward=LetterReward(),
                          args=config(tmp_path / estimator, estimator=estimator, **kw),
                          train_dataset=toy_dataset(8), processing_class=AutoTokenizer.from_pretrained(model_dir))

    trainer("vpo", max_steps=1, save_strategy="steps", save_steps=1).train()
    assert (tmp_path / "vpo" / "checkpoint-1").is_dir()
    card = ModelCard.load(tmp_path / "vpo" / "README.md")  # what TRL wrote when it saved the checkpoint
    assert "This model was trained with VPO, a method introduced in [Vector Policy Optimization]" \
        "(https://huggingface.co/papers/2605.22817)" in card.text
    assert "GRPO" not in card.text and {"trl", "vpo"} <= set(card.data.tags) and "grpo" not in card.data.tags
    trainer("grpo", num_answers=1).create_model_card(model_name="grpo")  # a baseline arm's card
    card = ModelCard.load(tmp_path / "grpo" / "README.md")
    assert "This model was trained with the grpo estimator of the VPO trainer." in card.text
    assert {"trl", "vpo", "grpo"} <= set(card.data.tags) and "DeepSeekMath" not in card.text
