"""vLLM 0.34's extensible KV cache rebinds every layer after CUDA-graph capture (fewer blocks,
same addresses). The ring's cursor must keep the address the graphs captured; this runs it.

A tiny decisive Qwen3.5 checkpoint, 24 requests of 16-64 greedy tokens through 8 sequences (so
requests arrive while others decode: those mixed steps run eagerly, beside graph-replayed decode
steps, and each reads the cursor through the layer; with 8 requests all admitted at once, every
decode step ran in a graph and the old bind went unseen on the H100), prefix caching on, the
extensible cache on, CUDA graphs with the GDN kernels inside them (breakable graphs off: with
them, vLLM 0.34's default for Qwen3.5, the GDN core runs eagerly between graph pieces and no
graph holds the cursor). Each arm in its own process, the engine in it
(VLLM_ENABLE_V1_MULTIPROCESSING=0): native; patched (ring 8, min_batch 1, strict, poisoned
rings); and patched with the bind as it was before the fix (`cursor_per_bind`: a fresh cursor
at every bind, at a new address, so the graphs keep the first one; engine_runner.fresh_cursor
says why the address must be forced). Checked: the rebind happened and kept the cursor (the
`cursor_rebinds` counter), the patched tokens agree with native's, and the old bind does not
(wrong tokens, or the strict shadow check stopping the engine): the test can fail.

vLLM >= 0.34 on CUDA (`bash benchmarks/gpu_run.sh v034`); skipped elsewhere.
"""

from __future__ import annotations

import random

import pytest

from replayssm_patch.testing import gpu_engines

gpu_engines.require_cuda("0.34", "the extensible KV cache")
pytestmark = pytest.mark.gpu

from replayssm_patch.testing import cache_dir  # noqa: E402
from replayssm_patch.testing.agreement import compare  # noqa: E402
from replayssm_patch.testing.engine_runner import run_arm  # noqa: E402
from replayssm_patch.testing.tiny_models import DECISIVE, build_tiny_model  # noqa: E402

RING = 8
REQUESTS = 24
MIN_TOKENS, MAX_TOKENS = 16, 64
ENGINE = dict(gpu_engines.ENGINE, max_num_seqs=8, enable_prefix_caching=True, enable_extensible_kv_cache=True,
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
GRAPHS_WITH_GDN = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}


def test_cursor_survives_the_rebind_after_capture(tmp_path):
    model = str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen3_5", **DECISIVE))
    rng = random.Random(34)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(5, 120))] for _ in range(REQUESTS)]
    max_tokens = [rng.randrange(MIN_TOKENS, MAX_TOKENS + 1) for _ in prompts]
    engines = [{"name": "q35", "engine": ENGINE, "prompts": prompts, "max_tokens": max_tokens}]
    patched_spec = {"model": model, "patched": True, "ring_len": RING, "min_batch": 1, "engines": engines}
    native, _ = run_arm(tmp_path, "native", {"model": model, "patched": False, "engines": engines},
                        extra_env=GRAPHS_WITH_GDN)
    patched, log = run_arm(tmp_path, "patched", patched_spec, extra_env=GRAPHS_WITH_GDN)
    entry = patched["q35"]
    assert entry["ring_counters"].get("cursor_rebinds", 0) > 0, (entry["ring_counters"], log[-3000:])
    assert entry["ring_counters"].get("decode_calls", 0) > 0, entry["ring_counters"]
    assert entry["layers"] and all(layer["ring"] for layer in entry["layers"]), entry["layers"]
    agreement = compare(native["q35"]["requests"], entry["requests"], tie_gap=0.01)
    print(f"[rebind] patched vs native: {agreement.summary()}")
    assert agreement.ok(0.9), agreement.failures

    try:
        old, old_log = run_arm(tmp_path, "cursor_per_bind", dict(patched_spec, cursor_per_bind=True),
                               extra_env=GRAPHS_WITH_GDN)
    except AssertionError as e:  # the engine stopped (the strict shadow check, or a fault)
        print(f"[rebind] the old bind stopped the engine: {str(e)[-600:]}")
        return
    old_agreement = compare(native["q35"]["requests"], old["q35"]["requests"], tie_gap=0.01)
    print(f"[rebind] old bind vs native: {old_agreement.summary()}")
    assert not old_agreement.ok(0.9), "the old bind agreed with native: this test does not see the rebind"
