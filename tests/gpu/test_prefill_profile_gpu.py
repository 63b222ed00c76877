"""The GDN prefill step a ring layer adds to vLLM's memory profile, in a real CUDA engine
(replayssm_patch/vllm/prefill_profile.py, issue 46).

A tiny decisive Qwen3.5 checkpoint (GDN heads of 128), two arms in their own processes at the same
`gpu_memory_utilization`: native, and patched (ring 8, min_batch 1, strict, poisoned rings). The
patched engine must log the step (the profile's tokens over `max_num_seqs` sequences) and size its
KV cache smaller than native's by at least the step's own memory less native's profiled peak
activation (measured here, in this process, by benchmarks/gdn_prefill_memory.py on the same
shapes); its tokens must still meet the agreement criterion against native's.

vLLM >= 0.33 on CUDA (`bash benchmarks/gpu_run.sh prefillprof`); skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
import random
import re
from pathlib import Path

import pytest

from replayssm_patch.testing import gpu_engines

gpu_engines.require_cuda("0.33", "vLLM's prefill-kernel warmup in the memory profile")
pytestmark = pytest.mark.gpu

from replayssm_patch.testing import cache_dir  # noqa: E402
from replayssm_patch.testing.agreement import compare  # noqa: E402
from replayssm_patch.testing.engine_runner import run_arm  # noqa: E402
from replayssm_patch.testing.tiny_models import DECISIVE, build_tiny_model  # noqa: E402

TOKENS, SEQS = 8192, 256  # max_num_batched_tokens, max_num_seqs
ENGINE = dict(gpu_engines.ENGINE, max_num_seqs=SEQS, max_num_batched_tokens=TOKENS, enable_prefix_caching=False,
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
GRAPHS_WITH_GDN = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}  # vLLM 0.34 on the GPU hosts' torch (gpu_run.sh)
KV_MEMORY = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
PEAK = re.compile(r"([\d.]+) GiB for peak activation")
BENCHMARKS = Path(__file__).parent.parent.parent / "benchmarks"


def _step_gib(model: str) -> float:
    """What prefill_profile.prefill_step holds above its input for the checkpoint's GDN layer, per
    group as the ring layers run it (vLLM >= 0.33, Triton prefill), as benchmarks/gdn_prefill_memory.py
    --grouped measures it (the autotuner's first tries out of the way first)."""
    import json

    spec = importlib.util.spec_from_file_location("gdn_prefill_memory", BENCHMARKS / "gdn_prefill_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = json.load(open(f"{model}/config.json"))
    cfg = cfg.get("text_config", cfg)
    hk, hv, d = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"]
    assert cfg["linear_value_head_dim"] == d, cfg  # the benchmark's layer has one head dim
    bench.measure(64, 1, hk, hv, d, "float32", True)
    return bench.measure(TOKENS, SEQS, hk, hv, d, "float32", True)["peak_above_inputs_gib"]


def test_the_ring_engine_profiles_a_whole_prefill_step(tmp_path):
    model = str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen3_5", **DECISIVE))
    rng = random.Random(46)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(5, 60))] for _ in range(12)]
    engines = [{"name": "q35", "engine": ENGINE, "prompts": prompts, "max_tokens": [24] * len(prompts)}]
    native, native_log = run_arm(tmp_path, "native", {"model": model, "patched": False, "engines": engines},
                                 extra_env=GRAPHS_WITH_GDN)
    patched, log = run_arm(tmp_path, "patched", {"model": model, "patched": True, "ring_len": 8, "min_batch": 1,
                                                 "engines": engines}, extra_env=GRAPHS_WITH_GDN)
    assert f"GDN prefill step of {TOKENS} tokens over {SEQS} sequences (triton prefill, per group" in log, log[-3000:]
    assert all(layer["ring"] for layer in patched["q35"]["layers"]), patched["q35"]["layers"]
    (kv_native, peak_native), (kv_ring, peak_ring) = (
        (float(KV_MEMORY.findall(x)[-1]), float(PEAK.findall(x)[-1])) for x in (native_log, log))
    step = _step_gib(model)
    print(f"[prefill profile] the step holds {step:.3f} GiB; profiled peak activation native {peak_native:.2f} GiB, "
          f"ring {peak_ring:.2f} GiB; available KV memory native {kv_native:.2f} GiB, ring {kv_ring:.2f} GiB")
    # the ring engine's profile saw the step (vLLM logs GiB to two decimals), and its KV cache gave
    # up what the step holds beyond vLLM's own peak
    assert peak_ring >= step - 0.02, (peak_ring, step)
    assert kv_native - kv_ring >= step - peak_native - 0.02, (kv_native, kv_ring, step, peak_native)
    agreement = compare(native["q35"]["requests"], patched["q35"]["requests"], tie_gap=0.01)
    print(f"[prefill profile] patched vs native: {agreement.summary()}")
    assert agreement.ok(0.9), agreement.failures
