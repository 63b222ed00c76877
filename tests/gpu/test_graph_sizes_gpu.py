"""The ring's verify graph sizes on a real CUDA engine config (replayssm_patch/vllm/graph_sizes.py):
vLLM's `EngineArgs.create_engine_config` for the capacity benchmark's 9B shape with MTP, no engine
started. With `patch(allow_mtp="ring")`, the GPU's memory is read in this (front-end) process, the plan estimates
the requests that fit, and the capture sizes end at the verify batch of `graphed_requests` of them
(from vLLM 0.34 also its decode request counts); unpatched, vLLM's own sizes stand.

vLLM >= 0.32 on CUDA (`bash benchmarks/gpu_run.sh ktest` with KTESTS naming this file); skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from replayssm_patch.testing import gpu_engines

gpu_engines.require_cuda("0.32", "the ring serves MTP on CUDA")
pytestmark = pytest.mark.gpu

BENCHMARKS = Path(__file__).parent.parent.parent / "benchmarks"


def _capacity_module():
    spec = importlib.util.spec_from_file_location("capacity", BENCHMARKS / "capacity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _engine_config(tmp_path, T: int, max_num_seqs: int):
    from vllm.engine.arg_utils import EngineArgs

    capacity = _capacity_module()
    args = capacity.parser().parse_args(["--shape", "9b", "--mtp", str(T), "--max-num-seqs", str(max_num_seqs),
                                         "--in-len", "512"])
    model = tmp_path / f"qwen35-9b-t{T}"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(capacity.model_config(args)))
    args.model = str(model)
    return EngineArgs(**capacity.engine_kwargs(args)).create_engine_config()


def test_verify_graphs_end_at_the_requests_that_fit(tmp_path, clean_patch_state, capfd):
    import replayssm_patch
    from replayssm_patch import plan
    from replayssm_patch.vllm import graph_sizes

    native = _engine_config(tmp_path / "native", 3, 512).compilation_config
    assert replayssm_patch.patch(allow_mtp="ring")["applied"]  # the ring asked for: on every release
    capfd.readouterr()
    config = _engine_config(tmp_path / "ring", 3, 512)
    logged = "".join(capfd.readouterr())  # vLLM's log handler (the package logs under vllm.) writes to stdout
    cc, query_len = config.compilation_config, 4
    p = plan.front_end_plan(config, clean_patch_state.config)
    fit = plan.ring_requests_that_fit(config, p, plan.front_end_memory())
    requests = graph_sizes.graphed_requests(512, fit)
    print(f"[graph sizes] native ends at {native.max_cudagraph_capture_size} tokens; ring: about {fit:.1f} "
          f"requests fit, graphs to {requests} requests, {cc.max_cudagraph_capture_size} tokens, "
          f"{len(cc.cudagraph_capture_sizes)} sizes (native {len(native.cudagraph_capture_sizes)})")
    assert fit is not None and 0 < fit < 512
    assert set(native.cudagraph_capture_sizes) <= set(cc.cudagraph_capture_sizes)
    expected = max(n * query_len for n in graph_sizes.request_grid(requests)
                   if n * query_len <= config.scheduler_config.max_num_batched_tokens)
    assert cc.max_cudagraph_capture_size == max(expected, native.max_cudagraph_capture_size)
    if hasattr(cc, graph_sizes.DECODE_REQUESTS) and expected > native.max_cudagraph_capture_size:
        # vLLM 0.34+: the verify graphs are captured by these request counts, not by the token list
        assert cc.max_decode_cudagraph_capture_requests == requests
        assert requests in cc.decode_cudagraph_capture_request_sizes
    if expected > native.max_cudagraph_capture_size:
        assert f"up to {requests} requests" in logged and "requests fit its memory" in logged
