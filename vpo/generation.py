"""The one generation helper: batched, seeded sampling of completions for a list of prompts.

``sample`` returns, for every prompt, ``n`` decoded completions (prompt text excluded, cut at
end-of-sequence, special tokens removed). A prompt is plain text or a conversation (a list of
``{"role", "content"}`` messages, see :mod:`vpo.chat`), which is rendered with the tokenizer's chat
template and its generation prompt. Two backends share that contract:

* ``"transformers"``: ``model.generate`` with the KV cache, left padding, ``do_sample`` (greedy
  when ``temperature == 0``), top-k disabled, in chunks of at most ``batch_size`` sequences.
  Reproducible for a given seed, model and chunking; the global torch RNG is left untouched.
* ``"vllm"``: ``vllm.LLM(model=path).generate(prompts, SamplingParams(n=..., seed=...))`` for GPU
  machines, when ``import vllm`` works in this process. One engine at a time (:class:`EngineSlot`):
  asking for another checkpoint's engine shuts the current one down and frees its GPU memory first, so
  each engine can take the share ``gpu_memory_utilization`` gives it.

:func:`generate_batch` is the lower-level transformers call that also returns token ids and masks,
for trainers that need the sampled tokens (left-padded prompt ids + right-padded completion ids).
"""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from vpo.chat import Messages, is_conversation, tokenize_prompts
from vpo.shared_prefix import shared_prefix_generate

__all__ = ["BACKENDS", "ENGINES", "VLLM_MISSING", "EngineSlot", "Generation", "generate_batch", "load_policy",
           "policy_device", "release_policy", "sample", "vllm_available"]

BACKENDS = ("transformers", "vllm")


def vllm_available() -> bool:
    """Whether the optional vLLM backend can be imported here."""
    return importlib.util.find_spec("vllm") is not None


VLLM_MISSING = ("the vllm backend needs vLLM importable in this process, and vLLM cannot be installed beside vpo "
                "(its fastapi pin conflicts with prefect's; it runs from its own environment as a server, see "
                "docs/gpu.md): sample with the transformers backend on the GPU instead (evaluation.use_vllm: false)")
"""What the vLLM backend says when vLLM is not importable here (the truth about installing it)."""


def policy_device(cuda: bool | None = None) -> str:
    """Where a policy is sampled: the first GPU this process sees (a stage slot's ``CUDA_VISIBLE_DEVICES``
    restricts it to its own), else the CPU. ``cuda``: whether CUDA is available (None: ask torch)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    return "cuda:0" if cuda else "cpu"


def load_policy(path: str | Path, *, device: str | torch.device | None = None, dtype: str | torch.dtype = "auto",
                **init_kwargs: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a saved causal LM and its tokenizer (left padding enforced) in eval mode, on ``device``
    (default :func:`policy_device`) in ``dtype`` (``"auto"``: the dtype it was saved in); ``init_kwargs``
    go to ``from_pretrained`` (e.g. ``attn_implementation``). The weights are read straight onto the device."""
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    target = torch.device(device if device is not None else policy_device())
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, device_map=str(target), **init_kwargs)
    model.eval()
    return model, tok


@dataclass
class Generation:
    """One generate call over B prompts x n samples, rows grouped n per prompt in prompt order:
    ``prompt_ids``/``prompt_mask`` (B*n, P) left-padded, ``completion_ids``/``completion_mask``
    (B*n, C) right-padded (the mask covers the tokens up to and including the first eos), and
    ``texts`` the decoded completions (special tokens removed)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    texts: list[str]


@torch.no_grad()
def generate_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str | Messages],
    n: int = 1,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> Generation:
    """Sample ``n`` completions per prompt in one ``generate`` call (uses the current torch RNG).
    Conversations are rendered with the chat template (:func:`vpo.chat.tokenize_prompts`)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if tokenizer.padding_side != "left":
        raise ValueError("generation needs a left-padding tokenizer (tokenizer.padding_side = 'left')")
    enc = tokenize_prompts(tokenizer, list(prompts), return_tensors="pt", padding=True)
    # expand each prompt n times ourselves: same as num_return_sequences for sampling, and it
    # also works for greedy decoding
    enc = {
        k: v.repeat_interleave(n, dim=0).to(model.device)
        for k, v in enc.items()
        if k in ("input_ids", "attention_mask")
    }
    greedy = temperature <= 0
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "num_return_sequences": 1,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "use_cache": True,
    }
    if greedy:
        kwargs.update(do_sample=False, top_k=None, top_p=None, temperature=None)
    else:
        kwargs.update(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0)
    was_training = model.training
    model.eval()
    try:
        with shared_prefix_generate(model):  # the n copies of a prompt are prefilled once
            out = model.generate(**enc, **kwargs)
    finally:
        model.train(was_training)
    completion = out[:, enc["input_ids"].shape[1] :]
    is_eos = completion == tokenizer.eos_token_id
    # keep tokens up to and including the first eos; everything after is padding
    after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    mask = (~after_eos).long()
    texts = [
        tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
        for ids, m in zip(completion, mask, strict=True)
    ]
    return Generation(enc["input_ids"], enc["attention_mask"], completion, mask, texts)


def sample(
    model: str | Path | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    prompts: Sequence[str | Messages],
    n: int = 1,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    seed: int = 0,
    *,
    top_p: float = 1.0,
    batch_size: int = 256,
    backend: str = "transformers",
    progress: bool = False,
    load: Mapping[str, Any] | None = None,
    engine: Mapping[str, Any] | None = None,
) -> list[list[str]]:
    """Sample ``n`` completions for every prompt; returns ``[[completion] * n] * len(prompts)``.

    ``model`` is a checkpoint folder or a loaded model (``tokenizer`` may be None for a folder).
    ``batch_size`` bounds the number of sequences generated at once (transformers backend).
    Prompts are plain text or conversations (rendered with the chat template), one kind per call.
    ``load``: :func:`load_policy` options for a folder (device, dtype, ...); ``engine``: ``vllm.LLM``
    options (``gpu_memory_utilization``, ``dtype``, ...).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if not prompts:
        return []
    if backend == "vllm":
        return _sample_vllm(model, prompts, n, max_new_tokens, temperature, seed, top_p, engine or {})
    if isinstance(model, (str, Path)):
        loaded, tok = load_policy(model, **dict(load or {}))
        model, tokenizer = loaded, tokenizer or tok
    if tokenizer is None:
        raise ValueError("a tokenizer is needed when model is an in-memory model")
    if tokenizer.padding_side != "left":
        tokenizer.padding_side = "left"
    per_call = max(1, batch_size // n)
    chunks = [list(prompts[i : i + per_call]) for i in range(0, len(prompts), per_call)]
    results: list[list[str]] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), desc="sampling", unit="prompt")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for chunk in chunks:
            gen = generate_batch(model, tokenizer, chunk, n, max_new_tokens, temperature, top_p)
            results.extend(gen.texts[i * n : (i + 1) * n] for i in range(len(chunk)))
            if bar is not None:
                bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return results


class EngineSlot:
    """At most one generation engine alive in this process. :meth:`get` returns the engine of ``key``,
    building it with ``build(key, **options)``; when another key's engine is alive it is released first
    (``release(engine)``: shut down, references dropped, GPU memory returned), so a new engine never
    starts beside an old one. An engine with the same key but other options is rebuilt the same way."""

    def __init__(self, build: Callable[..., Any], release: Callable[[Any], None]) -> None:
        self._build, self._release = build, release
        self.key: tuple[str, tuple[tuple[str, Any], ...]] | None = None
        self.engine: Any = None

    def get(self, key: str, **options: Any) -> Any:
        """The engine of ``key`` with ``options`` (the one alive, or a new one after releasing it)."""
        wanted = (key, tuple(sorted(options.items())))
        if self.engine is not None and self.key == wanted:
            return self.engine
        self.close()
        self.engine, self.key = self._build(key, **options), wanted
        return self.engine

    def close(self) -> None:
        """Release the engine alive (if any); the next :meth:`get` builds a new one."""
        engine, self.engine, self.key = self.engine, None, None
        if engine is not None:
            self._release(engine)


def _build_vllm(key: str, **options: Any) -> Any:
    from vllm import LLM

    return LLM(model=key, **options)


def _release_vllm(engine: Any) -> None:
    """Shut a vLLM engine down (its engine-core process, the distributed state it set up) and return its
    GPU memory before the next engine starts."""
    core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
    if core is not None and callable(getattr(core, "shutdown", None)):
        core.shutdown()
    del engine
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except (ImportError, AssertionError, RuntimeError):  # nothing was set up, or another vLLM layout
        pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


ENGINES = EngineSlot(_build_vllm, _release_vllm)
"""This process's one vLLM engine (evaluation and search sample one policy after another)."""


def release_policy() -> None:
    """Free what the last policy held before the next one loads: its vLLM engine (:data:`ENGINES`) and the
    CUDA allocator's cached blocks of a transformers model already dropped."""
    ENGINES.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sample_vllm(
    model: str | Path | PreTrainedModel,
    prompts: Sequence[str | Messages],
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    top_p: float,
    engine: Mapping[str, Any],
) -> list[list[str]]:
    """vLLM backend: the checkpoint folder's engine (:data:`ENGINES`, one alive at a time)."""
    if not vllm_available():
        raise RuntimeError(VLLM_MISSING)
    if not isinstance(model, (str, Path)):
        raise TypeError("the vllm backend loads models by path; pass the checkpoint folder")
    from vllm import SamplingParams

    llm = ENGINES.get(str(Path(model).resolve()), **dict(engine))  # each request is seeded (SamplingParams)
    params = SamplingParams(
        n=n,
        temperature=max(0.0, float(temperature)),
        top_p=float(top_p),
        top_k=-1,
        max_tokens=max_new_tokens,
        seed=seed,
    )
    conv = [is_conversation(p) for p in prompts]
    if any(conv) and not all(conv):
        raise ValueError("mixing plain-text and conversational prompts in one call is not supported")
    if all(conv):  # rendered by the engine with the model's chat template, generation prompt added
        outputs = llm.chat([list(p) for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(list(prompts), params, use_tqdm=False)
    return [[choice.text for choice in out.outputs] for out in outputs]
