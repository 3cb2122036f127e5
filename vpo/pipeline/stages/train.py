"""Stage ``train``: one arm run (estimator x seed) trained from the base model with :class:`VPOTrainer`.

The settings reach :class:`VPOConfig` through the one mapping in :mod:`vpo.pipeline.config.settings`
(:func:`~vpo.pipeline.config.settings.vpo_config_kwargs`). When it starts, the stage states the run's batch
in TRL's terms (prompts and completions per optimizer step and per generation round, on the world
size it will train on); the run record (``metrics.json``) holds the same numbers and the prompts the
trainer actually generated. With ``trainer.lora`` TRL trains LoRA adapters (a peft config) and the
published model is the merged one, a plain Hugging Face folder (the adapter beside it in ``adapter/``
with ``save_adapter``); the record says ``lora`` and ``merged``.
Resumable: checkpoints every ``trainer.save_steps`` under ``arms/<run>/trainer/``; a rerun of the same
request resumes from the newest intact one ("resuming from checkpoint-N"), skipping damaged ones.
Checkpoints made for another request (other settings, code or inputs) are deleted first, with the
reason, so a run never continues another estimator's or learning rate's weights. A run whose newest
checkpoint is already at ``max_steps`` (killed while saving its final model) publishes that
checkpoint's weights instead of training further. The final model folder is swapped in atomically;
the checkpoints are deleted once the run's record is written (:mod:`vpo.pipeline.runner`).

With ``trainer.accelerate_config`` the stage runs itself again under ``accelerate launch`` (multi-GPU),
each rank with its share of the threads and sandbox workers; the launched processes train, every rank
takes part in gathering a sharded model (ZeRO-3, FSDP: :mod:`vpo.distributed_save`) and rank 0 writes
the outputs. The model is loaded with the run's ``model_init_kwargs`` (:mod:`vpo.pipeline.engine.policy`),
recorded in ``metrics.json`` (``model_init``).
Past one node (:mod:`vpo.pipeline.engine.nodes`) each node's stage launches its share and node 0
publishes; ``storage.checkpoints`` mirrors checkpoints (:mod:`vpo.pipeline.engine.mirror`);
``execution.vllm_gpus`` runs the generation server around the training (:mod:`vpo.pipeline.engine.vllm_server`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from vpo.atomic import atomic_dir, atomic_write_json
from vpo.distributed_save import save_from_shards
from vpo.pipeline.config.settings import accelerate_processes, arm_batch, peft_config, vpo_config_kwargs
from vpo.pipeline.engine.checkpoints import check_model_dir, checkpoint_step, latest_checkpoint
from vpo.pipeline.engine.console import detail, format_numbers, log, progress
from vpo.pipeline.engine.context import StageContext
from vpo.pipeline.engine.errors import StageError
from vpo.pipeline.engine.execution import rank_share
from vpo.pipeline.engine.inputs import load_rows, stage_command
from vpo.pipeline.engine.mirror import MIRROR_ENV, mirror_callback, mirror_url, restore_for
from vpo.pipeline.engine.nodes import launch as launch_node
from vpo.pipeline.engine.nodes import node_role, resume_text
from vpo.pipeline.engine.policy import load_train_model
from vpo.pipeline.engine.processes import CHILD_ENV
from vpo.pipeline.engine.state import read_state, why_stale, write_state
from vpo.pipeline.engine.vllm_server import for_run as vllm_server_for
from vpo.pipeline.memory import check_plan
from vpo.rewards import VectorReward

__all__ = ["CHILD_ENV", "HEADLINE", "ConsoleProgressCallback", "HarmlessMissingKeysFilter", "ProgressFileCallback",
           "headline", "leave_process_group", "run", "train"]

REQUEST_FILE = "request.json"


HEADLINE: tuple[tuple[str, str], ...] = (
    ("reward", "vpo/scalar_best_in_set"),
    ("E max", "vpo/expected_max"),
    ("diversity", "vpo/reward_diversity"),
    ("parse", "vpo/frac_unparsed"),
    ("loss", "loss"),
)
"""The numbers a training run shows while it trains (console bar, Prefect progress artifact): the
w*-scalar reward of the best answer in a rollout's set, VPO's expected max over Dirichlet weightings,
reward diversity in the group, the parse rate (1 - ``vpo/frac_unparsed``) and the loss."""


def headline(logs: Mapping[str, Any]) -> dict[str, float]:
    """The :data:`HEADLINE` numbers present in one training log record."""
    out = {}
    for name, key in HEADLINE:
        value = logs.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = 1.0 - float(value) if key == "vpo/frac_unparsed" else float(value)
    return out


class ConsoleProgressCallback(TrainerCallback):
    """The run's progress bar (steps and the :func:`headline` numbers) on the console; the full log
    record of every logging step goes to the log file. Replaces the Trainer's own bar and printer,
    which print a 40-key dict per logging step."""

    def __init__(self, label: str, enabled: bool = True) -> None:
        self.label, self.enabled = label, enabled
        self.bar: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.enabled and state.is_world_process_zero:
            self.bar = progress(self.label, state.max_steps, initial=state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.bar is not None:
            self.bar.update(to=state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kw: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        detail(f"{self.label} step {state.global_step}: " + json.dumps(dict(logs), default=str))
        numbers = headline(logs)
        if self.bar is not None and numbers:
            self.bar.numbers(numbers)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class HarmlessMissingKeysFilter(logging.Filter):
    """Drops the Trainer's "There were missing keys in the checkpoint model loaded" warning on resume
    when it is harmless: every missing key is a weight tied to another one (``lm_head.weight`` tied to
    the input embedding is stored once), and the tie still holds, so loading the embedding restored it.
    Any other missing key, or a broken tie, still gets through."""

    _MESSAGE = "There were missing keys in the checkpoint model loaded"

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def harmless(self, missing: set[str]) -> bool:
        """Whether loading a checkpoint without ``missing`` leaves the model whole."""
        tied = set(getattr(self.model, "_tied_weights_keys", None) or ())
        out, inp = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        return bool(missing) and missing <= tied and out is not None and inp is not None and out.weight is inp.weight

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if not msg.startswith(self._MESSAGE):
            return True
        if self.harmless(set(re.findall(r"'([^']+)'", msg))):
            detail(f"resume: {msg} -- tied to the input embedding, restored with it (harmless)")
            return False
        return True


class ProgressFileCallback(TrainerCallback):
    """Writes ``{"step", "max_steps", "last", "numbers", "rows"}`` to a JSON file at every log
    (``numbers``: :func:`headline` of the newest record, ``rows``: ``[step, numbers]`` of the last
    :attr:`ROWS` records): the orchestrator (a separate process) reads it to publish progress artifacts."""

    ROWS = 12

    def __init__(self, path: Path) -> None:
        self.path = path
        self.history: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kw: Any) -> None:
        if not state.is_world_process_zero:
            return
        if logs:
            self.history.append({"step": state.global_step, **{k: v for k, v in logs.items()
                                                               if isinstance(v, (int, float))}})
        tmp = self.path.with_suffix(".tmp")
        last = self.history[-1] if self.history else {}
        rows = [[rec["step"], headline(rec)] for rec in self.history if headline(rec)][-self.ROWS:]
        tmp.write_text(json.dumps({"step": state.global_step, "max_steps": state.max_steps, "last": last,
                                   "numbers": rows[-1][1] if rows else {}, "rows": rows}))
        os.replace(tmp, self.path)


def _dataset(ctx: StageContext, rows: Sequence[Mapping[str, Any]], tokenizer: Any) -> Any:
    """The training rows as a HF dataset: the model-facing prompt for the arm's answer format (a
    conversation for chat models, :func:`vpo.chat.model_prompt`; for goal-conditioned GRPO with the
    row's goal weighting written into it and kept as a column), nested fields as JSON text."""
    from datasets import Dataset

    from vpo.advantages import get_estimator, goal_condition_rows
    from vpo.chat import model_prompt

    task, run = ctx.task, ctx.arm_run
    records = []
    for r in rows:
        rec = {k: (json.dumps(v) if isinstance(v, (dict, list)) and k != "prompt" else v) for k, v in r.items()}
        rec["prompt"] = model_prompt(task, r, run.arm.num_answers, tokenizer)
        records.append(rec)
    if getattr(get_estimator(run.arm.estimator), "row_weights_column", None):  # goal-conditioned GRPO
        records = goal_condition_rows(records, list(task.reward.names), seed=run.seed,
                                      alpha=run.arm.weight_alpha,
                                      present=lambda rec: task.reward.present(_decode_row(rec)))
    return Dataset.from_list(records)


def _decode_row(row: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in row.items():
        if isinstance(v, str) and k != "prompt" and v[:1] in "[{":
            try:
                out[k] = json.loads(v)
                continue
            except json.JSONDecodeError:
                pass
        out[k] = v
    return out


class RowDecodingReward(VectorReward):
    """Delegates to a task reward after decoding JSON-encoded nested row fields (HF datasets
    stores ragged nested lists poorly, so the training dataset carries them as JSON strings)."""

    def __init__(self, inner: VectorReward) -> None:
        self._inner = inner
        self.names = inner.names
        self.answer_tag = inner.answer_tag

    def w_star(self) -> Any:
        return self._inner.w_star()

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> Any:
        return self._inner.score(answers, _decode_row(row))

    def present(self, row: Mapping[str, Any]) -> Any:
        return self._inner.present(_decode_row(row))

    def parse(self, completion: str, m: int) -> list[str]:
        return self._inner.parse(completion, m)

    def prefetch(self, completions: Sequence[str], rows: Sequence[Mapping[str, Any]], m: int) -> None:
        if hasattr(self._inner, "prefetch"):
            self._inner.prefetch(completions, [_decode_row(r) for r in rows], m)

    def dedup_key(self, answer: str) -> Any:
        return self._inner.dedup_key(answer)


def _check_prompt_lengths(ctx: StageContext, tok: Any, dataset: Any) -> None:
    """Every prompt (rendered as the model sees it) within ``trainer.max_prompt_length`` tokens
    (TRL 1.16 would not cut it)."""
    from vpo.chat import tokenize_prompts

    limit = ctx.cfg.trainer.max_prompt_length
    if limit is None:
        return
    for row in dataset:
        n = len(tokenize_prompts(tok, [row["prompt"]])["input_ids"][0])
        if n > limit:
            raise StageError(f"train row id {row.get('id')!r}: its prompt is {n} tokens, longer than "
                             f"trainer.max_prompt_length ({limit}); raise the limit or shorten the prompts")


def _fresh_checkpoints(ctx: StageContext, trainer_dir: Path) -> None:
    """Delete checkpoints made for another request (saying why), then record this request."""
    fp = ctx.fingerprint
    if fp is None:
        return
    request = trainer_dir / REQUEST_FILE
    if trainer_dir.is_dir() and any(trainer_dir.iterdir()):
        reason = why_stale(read_state(request), fp, trainer_dir, output_exists=True)
        if reason is not None:
            log(f"{ctx.arm_run.rid}: checkpoints in {trainer_dir} were made for another request ({reason}); "
                "deleting them and starting from step 0")
            shutil.rmtree(trainer_dir)
    write_state(request, fp, "", {})


def _summary(ctx: StageContext, log_history: Sequence[Mapping[str, Any]], seconds: float,
             resumed_from: str | None, measured: Mapping[str, Any] | None = None) -> dict[str, Any]:
    arm, run, cfg = ctx.arm_run.arm, ctx.arm_run, ctx.cfg
    logs = [rec for rec in log_history if "loss" in rec]
    tail = logs[-max(1, len(logs) // 4):]
    keys = sorted({k for rec in tail for k in rec if k.startswith(("vpo/", "reward", "entropy", "loss"))})
    lora = cfg.trainer.lora
    return {
        "estimator": arm.estimator, "num_answers": arm.num_answers, "num_generations": arm.rollouts_per_prompt,
        "seed": run.seed, "max_steps": arm.max_steps, "train_seconds": round(seconds, 1),
        "resumed_from": resumed_from,
        "batch": {**arm_batch(cfg, arm).record(), **({"measured": dict(measured)} if measured else {})},
        "lora": lora.model_dump(mode="json") if lora is not None else None,
        "merged": lora is not None,
        "final": {k: float(sum(r[k] for r in tail if r.get(k) is not None) / max(1, sum(r.get(k) is not None
                                                                                       for r in tail)))
                  for k in keys},
    }


def _publish(ctx: StageContext, save_model: Any, tok: Any, log_history: Sequence[Mapping[str, Any]],
             seconds: float, resumed_from: str | None, measured: Mapping[str, Any] | None = None, *,
             peft_model: Any = None, record: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Final model (atomic folder swap), history.json, then metrics.json. ``save_model(folder)`` writes
    the trained model; a LoRA run's ``peft_model`` is merged and saved instead (its adapter saved first,
    through ``save_model``, into ``adapter/`` when ``trainer.lora.save_adapter`` asks for it). ``record``:
    more of the run's record (how the model was loaded)."""
    layout, rid = ctx.layout, ctx.arm_run.rid
    lora = ctx.cfg.trainer.lora
    ctx.invalidate_record()  # the run folder is rewritten file by file from here on
    try:
        if peft_model is not None and lora is not None and lora.save_adapter:
            with atomic_dir(layout.arm_adapter(rid)) as tmp:
                save_model(str(tmp))
                tok.save_pretrained(str(tmp))
        else:
            shutil.rmtree(layout.arm_adapter(rid), ignore_errors=True)  # none left from an earlier request
        if peft_model is not None:  # a plain model: evaluation, search and the registry read it as they are
            save_model = peft_model.merge_and_unload().save_pretrained
        with atomic_dir(layout.arm_model(rid)) as tmp:
            save_model(str(tmp))
            tok.save_pretrained(str(tmp))
    except OSError as exc:
        raise StageError(f"could not write the final model of {rid} to {layout.arm_model(rid)} ({exc}); is the "
                         f"disk full? Free space and run `{stage_command(ctx.cfg, 'train', rid)}` again: it "
                         "resumes from the last checkpoint") from None
    summary = {**_summary(ctx, log_history, seconds, resumed_from, measured), **(record or {})}
    # the whole run's log (restored from the checkpoint on resume), not only this process's part
    history = [{"step": rec.get("step"), **{k: v for k, v in rec.items() if isinstance(v, (int, float))
                                              and not isinstance(v, bool)}}
               for rec in log_history]
    atomic_write_json(layout.arm_history(rid), history)
    atomic_write_json(layout.arm_metrics(rid), summary)
    numbers = format_numbers(headline(summary["final"]))
    merged = "; LoRA merged" if ctx.cfg.trainer.lora is not None else ""
    ctx.outcome(f"{ctx.arm_run.arm.max_steps} steps{merged}" + (f"; last quarter: {numbers}" if numbers else ""))
    return summary


def _publish_checkpoint(ctx: StageContext, checkpoint: Path) -> dict[str, Any]:
    """The run already reached max_steps in ``checkpoint`` (it was killed while saving its final
    model): publish that checkpoint's weights, train no further."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerState

    log(f"{ctx.arm_run.rid}: {checkpoint.name} is at the requested {ctx.arm_run.arm.max_steps} steps; "
        "publishing its weights without further training")
    tok = AutoTokenizer.from_pretrained(str(ctx.layout.base))
    state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    if ctx.cfg.trainer.lora is not None:  # a LoRA checkpoint holds the adapter: put it on the base model
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(ctx.layout.base)), str(checkpoint))
        return _publish(ctx, model.save_pretrained, tok, state.log_history, 0.0, checkpoint.name, peft_model=model)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    return _publish(ctx, model.save_pretrained, tok, state.log_history, 0.0, checkpoint.name)


@contextmanager
def _tracker_dirs(ctx: StageContext) -> Iterator[None]:
    """Trackers that write files write them into the run folder, not into ``trainer/`` (resume state,
    deleted once the run is recorded): TensorBoard's callback reads its folder when it is created."""
    if "tensorboard" not in ctx.cfg.trainer.report_to:
        yield
        return
    key, old = "TENSORBOARD_LOGGING_DIR", os.environ.get("TENSORBOARD_LOGGING_DIR")
    os.environ[key] = str(ctx.layout.arm_tensorboard(ctx.arm_run.rid))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def train(ctx: StageContext) -> dict[str, Any]:
    """Train the context's arm run (resuming when possible) and publish its outputs."""
    import torch
    from transformers import AutoTokenizer

    from vpo.trainer import VPOConfig, VPOTrainer

    cfg, layout, run = ctx.cfg, ctx.layout, ctx.arm_run
    rid = run.rid
    out = layout.arm(rid)
    trainer_dir = layout.arm_trainer(rid)
    out.mkdir(parents=True, exist_ok=True)
    if os.environ.get(CHILD_ENV) is None:
        _fresh_checkpoints(ctx, trainer_dir)
        restore_for(ctx)  # storage.checkpoints: the newest mirrored checkpoint when this machine has none
    resume = latest_checkpoint(trainer_dir)
    if resume is not None and (checkpoint_step(resume) or 0) >= run.arm.max_steps:
        return _publish_checkpoint(ctx, resume)
    cuda = torch.cuda.is_available()
    try:
        args = VPOConfig(**vpo_config_kwargs(cfg, run, trainer_dir, cuda=cuda, progress=ctx.progress))
    except ValueError as exc:  # TRL's or VPOConfig's own check of a value (e.g. an unknown loss_type)
        raise StageError(f"{rid}: TRL's GRPOConfig / VPOConfig rejected the settings of arm {run.arm.name!r} in "
                         f"pipeline {cfg.name!r}: {str(exc).splitlines()[0]}") from None
    check_plan(ctx, args)  # refuse before loading the model when the memory plan does not fit
    tok = AutoTokenizer.from_pretrained(str(layout.base))
    model, model_init = load_train_model(cfg, run.arm, layout.base, world=int(args.world_size))  # model_init_kwargs
    callbacks: list[Any] = [ProgressFileCallback(layout.arm_progress(rid)),
                            ConsoleProgressCallback(f"train@{rid}", enabled=ctx.progress)]
    if "dvclive" in cfg.trainer.report_to:
        from dvclive import Live
        from transformers.integrations import DVCLiveCallback

        callbacks.append(DVCLiveCallback(live=Live(dir=str(layout.arm_live(rid)), save_dvc_exp=False, dvcyaml=None,
                                                   report=None)))
    if (mirror := mirror_url(ctx)) is not None:
        callbacks.append(mirror_callback(mirror, cfg.storage.checkpoints_keep))
    dataset = _dataset(ctx, load_rows(cfg, "train", layout), tok)
    _check_prompt_lengths(ctx, tok, dataset)
    try:
        with _tracker_dirs(ctx):
            trainer = VPOTrainer(model=model, reward=RowDecodingReward(ctx.task.reward), args=args,
                                 train_dataset=dataset, processing_class=tok, callbacks=callbacks,
                                 peft_config=peft_config(cfg))
    except ValueError as exc:  # a combination of settings TRL's trainer refuses (e.g. evaluation without data)
        raise StageError(f"{rid}: TRL's GRPOTrainer rejected the settings of arm {run.arm.name!r} in pipeline "
                         f"{cfg.name!r}: {str(exc).splitlines()[0]}") from None
    _check_world(ctx, trainer.accelerator.num_processes)
    trainer.remove_callback(PrinterCallback)  # ConsoleProgressCallback shows the numbers that matter
    trainer.remove_callback(ProgressCallback)
    if resume is not None:
        log(f"{rid}: resuming from {resume.name} (step {checkpoint_step(resume)} of {run.arm.max_steps})")
    start_step = (checkpoint_step(resume) or 0) if resume is not None else 0
    t0 = time.time()
    trainer_log = logging.getLogger("transformers.trainer")
    missing_keys = HarmlessMissingKeysFilter(trainer.model)
    trainer_log.addFilter(missing_keys)
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:
        trainer_log.removeFilter(missing_keys)
    elapsed = time.time() - t0
    save_sharded = save_from_shards(trainer.model_wrapped)  # a collective under ZeRO-3 / FSDP: every rank gathers
    if not trainer.is_world_process_zero():
        return {}
    measured = {"optimizer_steps": trainer.state.global_step - start_step, "generation_rounds":
                trainer.generation_rounds, "prompts_generated": trainer.generated_prompts}
    if trainer.low_parse_steps:  # the per-step warnings went to the log file; one console line says it
        worst_step, worst = min(trainer.low_parse_steps, key=lambda sr: sr[1])
        log(f"{rid}: warning: {len(trainer.low_parse_steps)} of {run.arm.max_steps} steps parsed fewer than "
            f"{run.arm.min_parse_rate:.0%} of rollouts into the {run.arm.num_answers}-answer format (lowest "
            f"{worst:.0%} at step {worst_step}); unparsed rollouts score zero and teach nothing: warm the base up "
            "longer (sft.steps) or raise max_completion_length")
    lora_model = trainer.accelerator.unwrap_model(trainer.model) if cfg.trainer.lora is not None else None
    return _publish(ctx, save_sharded or trainer.save_model, tok, trainer.state.log_history, elapsed,
                    resume.name if resume else None, measured, peft_model=lora_model, record={"model_init": model_init})


def _check_world(ctx: StageContext, world: int) -> None:
    """The processes actually training are the ones the batch was planned (and stated) for; else one
    error naming where the planned world size came from."""
    cfg = ctx.cfg
    planned = arm_batch(cfg, ctx.arm_run.arm).world
    if world == planned:
        return
    source = (f"num_processes of trainer.accelerate_config {cfg.trainer.accelerate_config}"
              if cfg.trainer.accelerate_config else "WORLD_SIZE")
    raise StageError(
        f"{ctx.arm_run.rid}: {world} process(es) train this run, but its batch was planned for {planned} ({source}); "
        "accelerate starts a single process for distributed_type MULTI_CPU without an MPI hostfile: for several CPU "
        "processes use distributed_type MULTI_GPU with use_cpu: true (launched through torchrun)")


def _launch(ctx: StageContext, argv: Sequence[str]) -> dict[str, Any]:
    """Run this stage again under ``accelerate launch`` (the launched processes train); return the
    summary rank 0 wrote."""
    cfg = ctx.cfg
    config_file = str(cfg.resolve_path(cfg.trainer.accelerate_config or ""))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file,
           "-m", "vpo.pipeline.cli", *argv]
    share = rank_share(cfg, accelerate_processes(cfg) or 1)
    env = {**os.environ, CHILD_ENV: "1", **share.env(), **({MIRROR_ENV: url} if (url := mirror_url(ctx)) else {})}
    log(f"{ctx.arm_run.rid}: launching `accelerate launch --config_file {cfg.trainer.accelerate_config}`; "
        f"{share.describe()}")
    if (role := node_role(cfg)) is not None:  # one node of a multi-node run: node 0 publishes
        logs = ctx.layout.logs / "ranks" / f"{ctx.arm_run.rid}-node{role.rank}-{time.strftime('%Y%m%d-%H%M%S')}"
        launch_node(cmd, env, role, rid=ctx.arm_run.rid, log_dir=logs, resume=lambda: resume_text(ctx.cfg, ctx.arm_run, mirror_url(ctx)))
        return json.loads(ctx.layout.arm_metrics(ctx.arm_run.rid).read_text()) if role.is_main else {}
    proc = subprocess.run(cmd, env=env, check=False)
    if proc.returncode != 0:
        raise StageError(f"{ctx.arm_run.rid}: `accelerate launch` exited with {proc.returncode} (see its output "
                         f"above; trainer.accelerate_config = {cfg.trainer.accelerate_config})")
    return json.loads(ctx.layout.arm_metrics(ctx.arm_run.rid).read_text())


def run(ctx: StageContext) -> dict[str, Any]:
    """Check inputs and hardware, then train (directly or under ``accelerate launch``)."""
    cfg, layout = ctx.cfg, ctx.layout
    check_model_dir(layout.base, "base model", f"rebuild it with `{stage_command(cfg, 'base')}`")
    from transformers import AutoTokenizer

    from vpo.pipeline.stages.base import check_tokenizer

    check_tokenizer(AutoTokenizer.from_pretrained(str(layout.base)), f"base model {layout.base}")
    if os.environ.get(CHILD_ENV) is None:
        log(f"{ctx.arm_run.rid}: batch {arm_batch(cfg, ctx.arm_run.arm).describe()}")
    if cfg.trainer.accelerate_config and os.environ.get(CHILD_ENV) is None:
        role = node_role(cfg)
        if role is None or role.is_main:  # the other nodes of a run never delete node 0's checkpoints
            _fresh_checkpoints(ctx, layout.arm_trainer(ctx.arm_run.rid))
        restore_for(ctx)  # every node: each rank loads the checkpoint it resumes from
        with vllm_server_for(ctx, main_node=role is None or role.is_main):  # execution.vllm_gpus: its server
            return _launch(ctx, ["stage", "train", *cfg.cli_args(), "--arm", ctx.arm_run.arm.name,
                                 "--seed", str(ctx.arm_run.seed)])
    with vllm_server_for(ctx):
        return train(ctx)


def leave_process_group() -> None:
    """A launched rank leaves its process group once all its training is done, before the interpreter
    exits: left to finalization, gloo's worker threads can abort the process (SIGABRT) after the work."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
