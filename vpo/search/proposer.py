"""Proposal operators for the search: something that turns prompts into completions.

A :class:`Proposer` returns exactly one completion per prompt; the search asks for up to m
candidates inside that one completion (the multi-answer format). ``seed`` is chosen by the
search per iteration, so a proposer that is deterministic given (prompts, seed) makes the
whole search reproducible and resumable.

* :class:`ModelProposer`: a local Hugging Face checkpoint folder, sampled through
  ``vpo.generation.sample`` (or any function with its signature).
* :class:`OpenAIProposer`: an OpenAI-compatible HTTP server (vLLM, SGLang, llama.cpp, Ollama),
  using only the standard library.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

__all__ = ["ModelProposer", "OpenAIProposer", "Prompt", "Proposer", "ProposerError"]

Prompt = str | list[dict[str, Any]]
"""A plain-text prompt or a chat prompt (list of ``{"role", "content"}`` messages)."""

SampleFn = Callable[..., list[list[str]]]


class ProposerError(RuntimeError):
    """A proposer could not produce completions (bad server reply, wrong count, ...)."""


@runtime_checkable
class Proposer(Protocol):
    """Anything with ``propose(prompts, seed) -> one completion per prompt``."""

    def propose(self, prompts: Sequence[Prompt], seed: int) -> list[str]:
        """Return one completion for each prompt, deterministically for a given seed if possible."""
        ...


class ModelProposer:
    """A local checkpoint folder sampled with ``sample(model_or_dir, tokenizer, prompts, n,
    max_new_tokens, temperature, seed, **sample_kwargs) -> list[list[str]]`` (default:
    :func:`vpo.generation.sample`).

    With the transformers backend the model is loaded once on first use
    (:func:`vpo.generation.load_policy`) and kept until :meth:`close`; with ``load=False`` or a
    non-transformers ``backend`` (e.g. ``"vllm"``, which loads by path) the folder path is passed.
    ``load_kwargs`` go to :func:`~vpo.generation.load_policy` (device, dtype, attn_implementation).

    Chat models get conversations: a plain-text prompt becomes one user turn (after
    ``system_message`` if given) when ``chat`` is True, or, with ``chat=None`` (the default), when
    the tokenizer has a chat template (:func:`vpo.chat.has_chat_template`). The default sampler
    receives the conversations (it renders them and tokenizes without a second BOS, or hands them
    to vLLM's chat entry point); a custom ``sample_fn`` receives them rendered by the chat template (generation
    prompt added). Plain-text prompts to a model without a template pass through unchanged.
    """

    def __init__(
        self,
        model_dir: str | Any,
        *,
        max_new_tokens: int = 1024,
        temperature: float = 1.0,
        backend: str = "transformers",
        sample_fn: SampleFn | None = None,
        load: bool = True,
        tokenizer: Any = None,
        sample_kwargs: Mapping[str, Any] | None = None,
        chat: bool | None = None,
        system_message: str | None = None,
        load_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.load_kwargs = dict(load_kwargs or {})
        self.chat = chat
        self.system_message = system_message
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.backend = backend
        self.sample_kwargs = dict(sample_kwargs or {})
        if backend != "transformers":
            self.sample_kwargs.setdefault("backend", backend)
        self._sample_fn = sample_fn
        self._default_fn = sample_fn is None  # vpo.generation.sample: takes conversations as they are
        self._load = load and backend == "transformers"
        self._model: Any = None
        self._tokenizer: Any = tokenizer

    def _resolve(self) -> tuple[SampleFn, Any, Any]:
        fn = self._sample_fn
        if fn is None:
            from vpo.generation import sample as default_sample

            fn = self._sample_fn = default_sample
        if not self._load:
            return fn, self.model_dir, self._tokenizer
        if self._model is None:
            from vpo.generation import load_policy

            self._model, tok = load_policy(self.model_dir, **self.load_kwargs)
            if self._tokenizer is None:
                self._tokenizer = tok
        return fn, self._model, self._tokenizer

    def close(self) -> None:
        """Drop the loaded model or this checkpoint's vLLM engine (frees memory between arms); it reloads on
        next use."""
        self._model = None
        if self.backend == "vllm":
            from vpo.generation import release_policy

            release_policy()

    def _conversation(self, prompt: Prompt, chat: bool) -> Prompt:
        """A plain prompt as [system?, user] messages when the model is a chat model."""
        if not isinstance(prompt, str) or not chat:
            return prompt
        messages = [{"role": "user", "content": prompt}]
        if self.system_message:
            messages.insert(0, {"role": "system", "content": self.system_message})
        return messages

    def _render(self, prompt: Prompt, tok: Any) -> str:
        if isinstance(prompt, str):
            return prompt
        if tok is None or not hasattr(tok, "apply_chat_template"):
            raise ProposerError("chat prompts need a tokenizer with a chat template")
        return str(tok.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True))

    def propose(self, prompts: Sequence[Prompt], seed: int) -> list[str]:
        """Sample one completion per prompt from the checkpoint."""
        if not prompts:
            return []
        from vpo.chat import has_chat_template

        fn, model, tok = self._resolve()
        needs_tok = any(not isinstance(p, str) for p in prompts) or (self.chat is None and self._default_fn)
        if needs_tok and tok is None and not self._load:
            from transformers import AutoTokenizer

            tok = self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        chat = has_chat_template(tok) if self.chat is None else self.chat
        convs = [self._conversation(p, chat) for p in prompts]
        if self._default_fn:
            texts: list[Prompt] = convs  # vpo.generation.sample renders conversations itself
        else:
            texts = [self._render(p, tok) for p in convs]
        out = fn(model, tok, texts, 1, self.max_new_tokens, self.temperature, seed, **self.sample_kwargs)
        if len(out) != len(prompts) or any(len(o) < 1 for o in out):
            raise ProposerError(f"sample returned {len(out)} groups for {len(prompts)} prompts")
        return [str(o[0]) for o in out]


class OpenAIProposer:
    """An OpenAI-compatible server (``base_url`` like ``http://127.0.0.1:8000/v1``).

    Chat prompts go to ``/chat/completions``. Plain-text prompts go to ``/completions`` when
    ``mode="completions"`` and are wrapped as one user message when ``mode="chat"``. Prompt i
    of a call is sent with ``seed + i`` (vLLM honours per-request seeds), so a call is
    reproducible on servers that support seeding. Requests run concurrently
    (``max_concurrency``) and failed ones are retried with exponential backoff.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        mode: str = "chat",
        api_key: str | None = None,
        max_tokens: int = 1024,
        temperature: float = 1.0,
        top_p: float | None = None,
        system_message: str | None = None,
        timeout: float = 300.0,
        retries: int = 3,
        retry_delay: float = 1.0,
        max_concurrency: int = 8,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        if mode not in ("chat", "completions"):
            raise ValueError(f"mode must be 'chat' or 'completions', got {mode!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.mode = mode
        self.api_key = api_key
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.system_message = system_message
        self.timeout = timeout
        self.retries = retries
        self.retry_delay = retry_delay
        self.max_concurrency = max(1, max_concurrency)
        self.extra_body = dict(extra_body or {})

    def request_for(self, prompt: Prompt, seed: int) -> tuple[str, dict[str, Any]]:
        """The (endpoint path, JSON body) sent for one prompt."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": int(seed),
            "n": 1,
        }
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if isinstance(prompt, str) and self.mode == "completions":
            body["prompt"] = prompt
            path = "/completions"
        else:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if self.system_message and not any(m.get("role") == "system" for m in messages):
                messages = [{"role": "system", "content": self.system_message}, *messages]
            body["messages"] = messages
            path = "/chat/completions"
        body.update(self.extra_body)
        return path, body

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read().decode("utf-8"))
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode("utf-8", "replace")[:500]
                last = ProposerError(f"{path}: HTTP {exc.code}: {detail}")
                if exc.code < 500 and exc.code != 429:
                    raise last from exc
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as exc:
                last = exc
            if attempt < self.retries:
                time.sleep(self.retry_delay * (2**attempt))
        raise ProposerError(f"{self.base_url}{path} failed after {self.retries + 1} attempts: {last}")

    @staticmethod
    def _text(path: str, reply: Mapping[str, Any]) -> str:
        try:
            choice = reply["choices"][0]
            content = choice["text"] if path == "/completions" else choice["message"].get("content")
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ProposerError(f"{path}: malformed reply {str(reply)[:300]}") from exc
        return "" if content is None else str(content)

    def _one(self, prompt: Prompt, seed: int) -> str:
        path, body = self.request_for(prompt, seed)
        return self._text(path, self._post(path, body))

    def propose(self, prompts: Sequence[Prompt], seed: int) -> list[str]:
        """One completion per prompt from the server, in prompt order."""
        if not prompts:
            return []
        if len(prompts) == 1 or self.max_concurrency == 1:
            return [self._one(p, seed + i) for i, p in enumerate(prompts)]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(prompts))) as pool:
            futures = [pool.submit(self._one, p, seed + i) for i, p in enumerate(prompts)]
            return [f.result() for f in futures]
