"""A ring engine whose layers run FlashInfer's GDN prefill on the state pool, against native vLLM
with the same prefill, in a real CUDA engine (replayssm_patch/vllm/flashinfer_pool_prefill.py,
issue 46).

The tiny decisive Qwen3.5 checkpoint with one MTP layer and echo drafts, GDN heads of 128 (the only
size FlashInfer's prefill takes); vLLM's FlashInfer GDN prefill, prefix caching off (the form's
only mode). Two arms in their own processes: native; patched (strict, poisoned rings, the form
switched on for this release in the arm's process: the engine runner's `pool_prefill_unvalidated`).
Two engines per arm: plain decode through the ring (min_batch 1), and MTP T=3 through the ring;
requests added one per step, so prefills share steps with decode and verify rows. The patched
engines must log their profile step on the pool, keep every GDN layer on the ring, and meet the
agreement criterion against native's tokens. Where this passes, the release goes into
`versions.FLASHINFER_POOL_PREFILL_VALIDATED`.

vLLM 0.33 on CUDA with FlashInfer (`bash benchmarks/gpu_run.sh fipoolengine`, after install and
fiinstall); skipped elsewhere.
"""

from __future__ import annotations

import random

import pytest

from replayssm_patch.testing import gpu_engines

gpu_engines.require_cuda("0.33", "vLLM's FlashInfer GDN prefill through the layer's op")
pytestmark = pytest.mark.gpu

from replayssm_patch.testing import cache_dir  # noqa: E402
from replayssm_patch.testing.agreement import compare  # noqa: E402
from replayssm_patch.testing.engine_runner import run_arm  # noqa: E402
from replayssm_patch.testing.tiny_models import DECISIVE, build_tiny_model  # noqa: E402
from replayssm_patch.vllm import flashinfer_pool_prefill  # noqa: E402

GDN_128 = dict(gdn_head_dim=128, num_key_value_heads=8, head_dim=128, num_attention_heads=8)
ENGINE = dict(gpu_engines.ENGINE, gdn_prefill_backend="flashinfer", enable_prefix_caching=False, max_num_seqs=8,
              max_num_batched_tokens=2048, disable_log_stats=False)
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def test_the_ring_engine_runs_flashinfers_prefill_on_the_pool_and_agrees_with_native(tmp_path):
    if not flashinfer_pool_prefill.flashinfer_takes_pool():
        pytest.skip("needs FlashInfer's GDN prefill with state_indices")
    model = str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen3_5", mtp_layers=1, echo_drafts=True,
                                 **DECISIVE, **GDN_128))
    rng = random.Random(48)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(20, 300))] for _ in range(16)]
    prompts[0] = prompts[0][:1]  # a one-token prefill beside the others
    engines = [{"name": name, "engine": dict(ENGINE, **extra), "scenario": "staggered", "prompts": prompts,
                "max_tokens": [48] * len(prompts)}
               for name, extra in (("plain", {}), ("mtp", {"speculative_config": MTP}))]
    native, _ = run_arm(tmp_path, "native", {"model": model, "patched": False, "engines": engines})
    patched, log = run_arm(tmp_path, "patched", {"model": model, "patched": True, "allow_mtp": True, "strict": True,
                                                 "ring_len": 16, "min_batch": 1, "pool_prefill_unvalidated": True,
                                                 "engines": engines})
    assert "(flashinfer prefill, on the state pool in place)" in log, log[-3000:]
    for name in ("plain", "mtp"):
        seen = patched[name]["engine_status"]
        assert seen["layers"] and all(v == "ring" for v in seen["layers"].values()), (name, seen)
        agreement = compare(native[name]["requests"], patched[name]["requests"], tie_gap=0.01)
        print(f"[pool prefill] {name}: patched vs native: {agreement.summary()} {agreement.divergences}; "
              f"ring counters {seen['counters']}")
        assert agreement.ok(0.9), (name, agreement.failures)
