"""Tests for the proposers and the OpenEvolve bridge against a fake OpenAI-compatible server.

The fake server (http.server on loopback, in a thread) serves /v1/models, /v1/chat/completions
and /v1/completions with canned programs and records every request.
"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import sys
import threading
import types
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import numpy as np
import pytest
import yaml

from vpo.rewards import VectorReward
from vpo.search import ModelProposer, OpenAIProposer, ProposerError, run_search
from vpo.search.openevolve_bridge import (
    OPENEVOLVE_MISSING,
    VLLMServer,
    evaluate_program,
    feature_names,
    program_text,
    run_openevolve,
    vllm_serve_command,
    wait_for_server,
    write_evaluator,
    write_openevolve_config,
)
from vpo.tasks import Task

CANNED = "```python\ndef f(x):\n    return x * 2\n```"


class FakeServer:
    """Records requests; replies with canned completions; can fail the first N requests."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_next = 0
        self.fail_code = 500
        self.reply: Any = None  # override the JSON reply
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(
                    {"path": self.path, "body": body, "auth": self.headers.get("Authorization")}
                )
                if outer.fail_next > 0:
                    outer.fail_next -= 1
                    self._send(outer.fail_code, {"error": "injected"})
                    return
                if outer.reply is not None:
                    self._send(200, outer.reply)
                    return
                text = f"{CANNED}\n# seed={body.get('seed')}"
                if self.path == "/v1/chat/completions":
                    self._send(
                        200,
                        {
                            "choices": [
                                {
                                    "index": 0,
                                    "message": {"role": "assistant", "content": text},
                                    "finish_reason": "stop",
                                }
                            ]
                        },
                    )
                elif self.path == "/v1/completions":
                    self._send(200, {"choices": [{"index": 0, "text": text, "finish_reason": "stop"}]})
                else:
                    self._send(404, {"error": "not found"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def server() -> Iterator[FakeServer]:
    with FakeServer() as s:
        yield s


class CodeReward(VectorReward):
    """Per-test reward for a program defining f: dims t0..t3, t3 absent when row says so."""

    names = ("t0", "t1", "t 2", "t3")

    def present(self, row: Mapping[str, Any]) -> np.ndarray:
        return np.array([True, True, True, row.get("four_tests", False)])

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> np.ndarray:
        present = self.present(row)
        out = np.full((len(answers), 4), np.nan)
        for i, code in enumerate(answers):
            env: dict[str, Any] = {}
            try:
                exec(code, env)  # noqa: S102 - test-only toy evaluator
                f = env["f"]
                results = [float(f(x) == y) for x, y in row["tests"]]
            except Exception:  # noqa: BLE001
                results = [0.0] * len(row["tests"])
            out[i, present] = results[: int(present.sum())]
        return out

    def parse(self, completion: str, m: int) -> list[str]:
        return [b.strip() for b in re.findall(r"```python\n(.*?)```", completion, flags=re.DOTALL)][:m]


class CodeTask(Task):
    name = "toy-code"

    def __init__(self) -> None:
        self.reward = CodeReward()

    def load(self, split: str) -> list[dict[str, Any]]:
        return [ROW]


ROW = {"id": "double", "prompt": "Write f(x) returning twice x.", "tests": [(1, 2), (2, 4), (0, 0)]}


# ---------------------------------------------------------------------- proposers


def test_openai_proposer_chat_and_completions(server: FakeServer) -> None:
    chat = OpenAIProposer(
        server.base_url,
        "policy",
        api_key="sk-test",
        max_tokens=77,
        temperature=0.5,
        system_message="be brief",
        max_concurrency=3,
    )
    prompts: list[Any] = ["p0", [{"role": "user", "content": "p1"}], "p2"]
    out = chat.propose(prompts, seed=10)
    assert [o.splitlines()[-1] for o in out] == ["# seed=10", "# seed=11", "# seed=12"]  # order kept
    reqs = sorted(server.requests, key=lambda r: r["body"]["seed"])
    assert all(r["path"] == "/v1/chat/completions" and r["auth"] == "Bearer sk-test" for r in reqs)
    assert reqs[0]["body"]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "p0"},
    ]
    assert reqs[1]["body"]["messages"][-1] == {"role": "user", "content": "p1"}
    assert all(
        r["body"]["model"] == "policy" and r["body"]["max_tokens"] == 77 and r["body"]["temperature"] == 0.5
        for r in reqs
    )
    server.requests.clear()
    comp = OpenAIProposer(server.base_url + "/", "policy", mode="completions")
    out = comp.propose(["raw prompt", [{"role": "user", "content": "chat"}]], seed=3)
    assert out[0].startswith("```python") and len(out) == 2
    paths = {r["body"]["seed"]: r["path"] for r in server.requests}
    assert paths == {3: "/v1/completions", 4: "/v1/chat/completions"}
    assert server.requests[0]["auth"] is None


def test_openai_proposer_retries_and_errors(server: FakeServer) -> None:
    prop = OpenAIProposer(server.base_url, "policy", retries=2, retry_delay=0.01)
    server.fail_next = 2
    assert prop.propose(["x"], seed=0)[0].startswith("```python")
    assert len(server.requests) == 3
    server.fail_next, server.fail_code = 1, 400  # client errors are not retried
    with pytest.raises(ProposerError, match="HTTP 400"):
        prop.propose(["x"], seed=0)
    server.reply = {"choices": []}
    with pytest.raises(ProposerError, match="malformed"):
        prop.propose(["x"], seed=0)
    server.reply = {"choices": [{"message": {"role": "assistant", "content": None}}]}
    assert prop.propose(["x"], seed=0) == [""]
    dead = OpenAIProposer("http://127.0.0.1:9/v1", "policy", retries=1, retry_delay=0.01, timeout=2)
    with pytest.raises(ProposerError, match="failed after 2 attempts"):
        dead.propose(["x"], seed=0)


def test_search_through_openai_proposer(server: FakeServer) -> None:
    res = run_search(ROW, CodeTask(), OpenAIProposer(server.base_url, "policy"), iterations=3, m=2, seed=0)
    assert res.solved and res.best_score == 1.0 and "return x * 2" in res.best_text
    assert res.iterations == 1 and len(server.requests) == 1  # stops once solved


def test_model_proposer_calls_sample_fn() -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_sample(
        model: Any, tok: Any, prompts: list[Any], n: int, max_new: int, temp: float, seed: int
    ) -> list[list[str]]:
        calls.append((model, tok, prompts, n, max_new, temp, seed))
        return [[f"{p}|{seed}"] for p in prompts]

    prop = ModelProposer(
        "/ckpt/vpo", max_new_tokens=64, temperature=0.7, sample_fn=fake_sample, load=False, tokenizer="TOK"
    )
    assert prop.propose(["a", "b"], seed=9) == ["a|9", "b|9"]
    assert calls == [("/ckpt/vpo", "TOK", ["a", "b"], 1, 64, 0.7, 9)]
    assert prop.propose([], seed=1) == []

    class ChatTok:
        def apply_chat_template(
            self, msgs: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool
        ) -> str:
            assert tokenize is False and add_generation_prompt is True
            return "".join(f"<{m['role']}>{m['content']}" for m in msgs) + "<assistant>"

    calls.clear()
    kw_calls: list[dict[str, Any]] = []

    def kw_sample(*args: Any, **kwargs: Any) -> list[list[str]]:
        calls.append(args)
        kw_calls.append(kwargs)
        return [["ok"] for _ in args[2]]

    vllm_prop = ModelProposer("/ckpt/vpo", backend="vllm", sample_fn=kw_sample, tokenizer=ChatTok())
    assert vllm_prop.propose([[{"role": "user", "content": "hi"}], "plain"], seed=2) == ["ok", "ok"]
    assert calls[0][0] == "/ckpt/vpo" and calls[0][2] == ["<user>hi<assistant>", "plain"]
    assert kw_calls == [{"backend": "vllm"}]
    bad = ModelProposer("/x", sample_fn=lambda *a: [["only one"]], load=False)
    with pytest.raises(ProposerError):
        bad.propose(["a", "b"], seed=0)


# ---------------------------------------------------------------------- evaluator + config


def _import(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"oe_eval_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_evaluator_module_scores_and_exposes_features(tmp_path: Path) -> None:
    reward = CodeReward()
    row4 = {**ROW, "id": "four", "four_tests": True, "tests": [(1, 2), (2, 4), (0, 0), (5, 10)]}
    assert feature_names(reward, ROW) == ["v_t0", "v_t1", "v_t_2"]
    assert feature_names(reward, row4) == ["v_t0", "v_t1", "v_t_2", "v_t3"]
    ev_path = write_evaluator(tmp_path / "w", reward, ROW)
    mod = _import(ev_path)
    assert mod.FEATURES == ["v_t0", "v_t1", "v_t_2"]
    good = tmp_path / "good.py"
    good.write_text("# EVOLVE-BLOCK-START\ndef f(x):\n    return 2 * x\n# EVOLVE-BLOCK-END\n")
    assert program_text(good) == "def f(x):\n    return 2 * x"
    assert mod.evaluate(str(good)) == {
        "combined_score": 1.0,
        "solved": 1.0,
        "v_t0": 1.0,
        "v_t1": 1.0,
        "v_t_2": 1.0,
    }
    half = tmp_path / "half.py"
    half.write_text("def f(x):\n    return x + 2 if x == 2 else x * 2 + (x == 0)\n")
    m = mod.evaluate(str(half))
    assert m["v_t0"] == 1.0 and m["v_t1"] == 1.0 and m["v_t_2"] == 0.0
    assert m["combined_score"] == pytest.approx(2 / 3) and m["solved"] == 0.0
    empty = tmp_path / "empty.py"
    empty.write_text("# EVOLVE-BLOCK-START\n# EVOLVE-BLOCK-END\n")
    e = mod.evaluate(str(empty))
    assert e["combined_score"] == 0.0 and "error" in e and set(mod.FEATURES) <= set(e)
    m4 = evaluate_program(good, write_evaluator(tmp_path / "w4", reward, row4).parent / "problem.pkl")
    assert set(m4) == {"combined_score", "solved", "v_t0", "v_t1", "v_t_2", "v_t3"}
    capped = _import(write_evaluator(tmp_path / "w5", reward, ROW, solved_threshold=0.6))
    assert capped.evaluate(str(half))["solved"] == 1.0


def test_config_yaml(tmp_path: Path) -> None:
    cfg = write_openevolve_config(
        tmp_path / "c.yaml",
        api_base="http://127.0.0.1:8000/v1",
        model="policy",
        feature_dimensions=["v_t0", "v_t1"],
        iterations=600,
        seed=3,
        system_message="solve it",
        overrides={"database.num_islands": 5, "prompt.num_top_programs": 2},
    )
    d = yaml.safe_load(cfg.read_text())
    assert d["llm"]["api_base"] == "http://127.0.0.1:8000/v1"
    assert d["llm"]["models"] == [{"name": "policy", "weight": 1.0}]
    assert d["database"]["feature_dimensions"] == ["v_t0", "v_t1"] and d["database"]["num_islands"] == 5
    assert d["database"]["feature_bins"] == {"v_t0": 2, "v_t1": 2}
    assert d["max_iterations"] == 600 and d["random_seed"] == 3 and d["database"]["random_seed"] == 3
    assert d["diff_based_evolution"] is False and d["evaluator"]["cascade_evaluation"] is False
    assert d["prompt"] == {"system_message": "solve it", "num_top_programs": 2}
    argv = vllm_serve_command("/ckpt", port=8123, served_model_name="vpo", seed=1)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--model") + 1] == "/ckpt"


def test_run_openevolve_missing_gives_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openevolve", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'vpo[openevolve]'")):
        run_openevolve(ROW, CodeTask(), api_base="http://x/v1", model="policy", out_dir=tmp_path)
    assert OPENEVOLVE_MISSING.startswith("OpenEvolve is not installed")


def test_run_openevolve_wiring_with_fake_openevolve(
    tmp_path: Path, server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in openevolve.run_evolution that does what the real one does at its core: read
    the YAML config, ask llm.api_base for a program, load the evaluator file and score it."""
    seen: dict[str, Any] = {}

    def run_evolution(
        initial_program: str, evaluator: str, config: str, iterations: int, output_dir: str, cleanup: bool
    ) -> Any:
        cfg = yaml.safe_load(Path(config).read_text())
        seen.update(
            cfg=cfg, initial=Path(initial_program).read_text(), iterations=iterations, cleanup=cleanup
        )
        body = {
            "model": cfg["llm"]["models"][0]["name"],
            "max_tokens": cfg["llm"]["max_tokens"],
            "messages": [
                {"role": "system", "content": cfg["prompt"]["system_message"]},
                {"role": "user", "content": "improve the program"},
            ],
        }
        req = urllib.request.Request(
            cfg["llm"]["api_base"] + "/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            content = json.loads(resp.read())["choices"][0]["message"]["content"]
        code = re.search(r"```python\n(.*?)```", content, flags=re.DOTALL).group(1)
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        prog = Path(output_dir) / "child.py"
        prog.write_text(code)
        metrics = _import(Path(evaluator)).evaluate(str(prog))
        seen["metrics"] = metrics
        return types.SimpleNamespace(best_score=metrics["combined_score"], best_code=code, metrics=metrics)

    monkeypatch.setitem(sys.modules, "openevolve", types.SimpleNamespace(run_evolution=run_evolution))
    out = run_openevolve(
        ROW, CodeTask(), api_base=server.base_url, model="policy", out_dir=tmp_path, iterations=12, seed=4
    )
    assert out["solved"] and out["best_score"] == 1.0 and "return x * 2" in out["best_code"]
    assert seen["iterations"] == 12 and seen["cleanup"] is False
    assert seen["cfg"]["database"]["feature_dimensions"] == ["v_t0", "v_t1", "v_t_2"]
    assert set(seen["cfg"]["database"]["feature_dimensions"]) <= set(seen["metrics"])
    assert "Write f(x) returning twice x." in seen["cfg"]["prompt"]["system_message"]
    assert "EVOLVE-BLOCK-START" in seen["initial"]
    assert server.requests[0]["body"]["model"] == "policy"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_server_readiness_and_lifecycle(server: FakeServer) -> None:
    assert wait_for_server(server.base_url, timeout=5) == ["policy"]
    port = _free_port()
    code = (
        "import json, http.server\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def log_message(self, *a): pass\n"
        "    def do_GET(self):\n"
        "        d = json.dumps({'data': [{'id': 'vpo'}]}).encode()\n"
        "        self.send_response(200); self.send_header('Content-Length', str(len(d))); self.end_headers()\n"
        "        self.wfile.write(d)\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    with VLLMServer(
        command=[sys.executable, "-c", code], port=port, served_model_name="vpo", ready_timeout=20
    ) as srv:
        assert srv.base_url == f"http://127.0.0.1:{port}/v1"
        assert wait_for_server(srv.base_url, timeout=5) == ["vpo"]
        proc = srv.process
    assert proc is not None and proc.poll() is not None  # terminated on exit
    with (
        pytest.raises(RuntimeError, match="exited"),
        VLLMServer(
            command=[sys.executable, "-c", "raise SystemExit(3)"], port=_free_port(), ready_timeout=20
        ),
    ):
        pass


def test_real_openevolve_against_fake_server(tmp_path: Path, server: FakeServer) -> None:
    """End to end with the real OpenEvolve package (skipped unless the extra is installed)."""
    pytest.importorskip("openevolve")
    out = run_openevolve(
        ROW, CodeTask(), api_base=server.base_url, model="policy", out_dir=tmp_path, iterations=2, seed=0
    )
    assert out["solved"] and out["best_score"] == 1.0 and "return x * 2" in out["best_code"]
    assert {"v_t0", "v_t1", "v_t_2"} <= set(out["metrics"])
    assert server.requests and all(r["body"]["model"] == "policy" for r in server.requests)
