"""The plan: a pure function of vLLM's config, the ReplayConfig and the measured tables.

Fake configs stand in for vLLM's (only the attributes the plan reads); CUDA is faked where a
test needs its decisions. The plain-decode rule (payoff) is checked against the end-to-end runs
it was calibrated on and on the shapes of the issue (9B and 4B dense, an A3B MoE).
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from replayssm_patch import payoff, plan
from replayssm_patch.config import ReplayConfig
from replayssm_patch.plan import NOT_PAYING, OPT_IN, UNSUPPORTED, make_plan

if not os.environ.get("CI"):
    pytest.importorskip("vllm")

from replayssm_patch.vllm import gdn_layer, model_class  # noqa: E402 (imported before CUDA is faked)

GIB = 1 << 30
T9 = (["linear_attention"] * 3 + ["full_attention"]) * 8
SHAPES = {  # hidden, intermediate, layer types, MoE (experts, expert width, shared, top-k), KV heads
    "9b": dict(hidden_size=4096, intermediate_size=12288, layer_types=T9),
    "4b": dict(hidden_size=2560, intermediate_size=9216, layer_types=T9),
    "a3b": dict(hidden_size=2048, intermediate_size=0, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
                num_experts=256, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                num_experts_per_tok=8, num_key_value_heads=2),
}


def fake_config(shape="9b", **over):
    hf = SimpleNamespace(**{**dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                   linear_value_head_dim=128, linear_conv_kernel_dim=4, num_attention_heads=16,
                                   num_key_value_heads=4, head_dim=256, vocab_size=151936, tie_word_embeddings=False),
                            **SHAPES[shape]})
    hf.num_hidden_layers = len(hf.layer_types)
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=hf, dtype=torch.bfloat16, architecture="Qwen3_5ForCausalLM",
                                     max_model_len=392, quantization=None),
        cache_config=SimpleNamespace(mamba_cache_dtype="auto", mamba_ssm_cache_dtype="float32",
                                     mamba_cache_mode="align", gpu_memory_utilization=0.9, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=16384),
        speculative_config=None, lora_config=None, kv_transfer_config=None,
    )
    for path, value in over.items():
        obj = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, value)
    return cfg


def mtp(T=3, method="mtp", **over):
    return fake_config(**{"cache_config.mamba_cache_mode": "none",
                          "speculative_config": SimpleNamespace(num_speculative_tokens=T, method=method), **over})


ON = ReplayConfig(enable=True)


@pytest.fixture
def on_cuda(monkeypatch):
    """A faked CUDA platform (vLLM 0.33.0, ring kernels loadable)."""
    from vllm.platforms import current_platform

    from replayssm_patch import ops, versions
    from replayssm_patch.vllm import gdn_layer  # noqa: F401 (vLLM's layer modules ask the platform as they import)

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self=None: True, raising=False)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False, raising=False)
    monkeypatch.setattr(ops, "kernels_available", lambda: (True, ""))
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.33.0")


def test_geometry_of_a_served_config():
    p = make_plan(fake_config(), ReplayConfig(enable=True, min_batch=1))
    g = p.geometry
    assert p.serves and p.min_batch == 1 and g.num_v_heads == 32 and g.ring_dtype == torch.float32
    assert g.bytes_per_slot == 32 * 16 * 128 * 4 + 16 * 16 * 128 * 4 + 32 * 16 * 4  # d, k (fp32), g
    assert make_plan(fake_config(), ReplayConfig(enable=True, min_batch=1, ring_dtype="activation")).geometry \
        .ring_dtype == torch.bfloat16
    bf16 = make_plan(fake_config(**{"cache_config.mamba_ssm_cache_dtype": "bfloat16"}),
                     ReplayConfig(enable=True, min_batch=1)).geometry
    assert bf16.ring_dtype == bf16.state_dtype == torch.bfloat16
    tp2 = make_plan(fake_config(**{"parallel_config.tensor_parallel_size": 2}), ReplayConfig(enable=True, min_batch=1))
    assert (tp2.geometry.num_k_heads, tp2.geometry.num_v_heads) == (8, 16)


@pytest.mark.parametrize("override,reason", [
    ({"lora_config": object()}, "LoRA"),
    ({"kv_transfer_config": object()}, "KV connector"),
    ({"parallel_config.pipeline_parallel_size": 2}, "pipeline parallel"),
    ({"cache_config.mamba_ssm_cache_dtype": "fp8"}, "SSM state dtype"),
    ({"model_config.hf_text_config.linear_key_head_dim": 96}, "head dims"),
    ({"cache_config.mamba_cache_mode": "all"}, "mamba_cache_mode"),
    ({"parallel_config.tensor_parallel_size": 3}, "tensor_parallel_size"),
    ({"model_config.hf_text_config": SimpleNamespace()}, "no Gated DeltaNet"),
    ({"model_config.runner_type": "pooling"}, "pooling model"),
])
def test_each_limitation_is_an_unsupported_reason(override, reason):
    p = make_plan(fake_config(**override), ReplayConfig(enable=True, min_batch=1))
    assert not p.serves and not p.by_choice
    assert any(reason in r.text and r.kind == UNSUPPORTED for r in p.reasons), p.reasons
    off = make_plan(fake_config(**override), ReplayConfig())
    assert not off.serves and [r.kind for r in off.reasons] == [OPT_IN]


def test_cpu_defaults_stay_native_by_the_rule_and_serve_on_request():
    """CPU: plain decode and MTP native by default (not paying there), the ring on request."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU defaults")
    plain = make_plan(fake_config(), ON)
    assert not plain.serves and plain.by_choice and [r.kind for r in plain.reasons] == [NOT_PAYING]
    assert make_plan(fake_config(), ReplayConfig(enable=True, min_batch=4)).min_batch == 4
    m = make_plan(mtp(3), ON)
    assert not m.serves and m.by_choice and "cpu_mtp_speed" in m.reasons[0].text
    for T, L in ((1, 16), (3, 16), (7, 16), (9, 20)):  # room for two windows of T+1
        served = make_plan(mtp(T), ReplayConfig(enable=True, allow_mtp="ring"))
        assert served.serves and served.geometry.ring_len == L and served.spec_window == T + 1
    native = make_plan(mtp(3), ReplayConfig(enable=True, allow_mtp="native"))
    assert not native.serves and [r.kind for r in native.reasons] == [OPT_IN]


@pytest.mark.parametrize("buffer_len,T", [(1, 3), (4, 3), (8, 3), (16, 3), (4, 7), (32, 7)])
def test_mtp_ring_length_from_vllms_flag(buffer_len, T):
    """--replayssm-buffer-len N is the ring length as ring_len is: with MTP the plan still makes
    room for two verify windows (spec_ring_len), whatever N; vLLM's own rule for its flag
    (N >= 1 + T) does not apply."""
    from replayssm_patch.config import from_vllm_flag

    p = make_plan(mtp(T), from_vllm_flag(buffer_len, {}))
    assert p.serves and p.geometry.ring_len == plan.spec_ring_len(buffer_len, T) == max(buffer_len, 2 * (T + 1))


def test_mtp_on_cuda_takes_the_ring_by_default(on_cuda):
    p = make_plan(mtp(7), ON, memory_bytes=80 * GIB)
    assert p.serves and p.spec_tokens == 7 and p.geometry.ring_len == 16 and "state slot" in p.rationale
    native = make_plan(mtp(7), ReplayConfig(enable=True, allow_mtp="native"), memory_bytes=80 * GIB)
    assert not native.serves and native.by_choice
    for bad, why in ((mtp(3, method="ngram"), "speculative method 'ngram'"),
                     (mtp(255), "a verify window must fit the ring")):
        p = make_plan(bad, ON, memory_bytes=80 * GIB)
        assert not p.serves and not p.by_choice and any(why in r.text for r in p.reasons), p.reasons


def test_mtp_with_prefix_caching_takes_the_ring(on_cuda, monkeypatch):
    """Align mode with MTP: served (the ring moves its own state between blocks) unless a block
    could hold two boundaries of a window, prefix_match_unit allows hits inside a block, or the GDN
    prefill backend is one the ring was not checked with (each a typed reason). Beside vLLM's
    FlashInfer GDN prefill, which writes checkpoints inside a chunk, it serves when asked and stays
    native by default until a GPU run validates it (an opt-in reason)."""
    align = {"cache_config.mamba_cache_mode": "align"}
    ring = ReplayConfig(enable=True, allow_mtp="ring")
    monkeypatch.setattr(plan, "gdn_prefill_backend", lambda cfg: "triton")
    for options in (ring, ON):  # the default options too, on the release the GPU test validated (0.33)
        p = make_plan(mtp(3, **align), options, memory_bytes=80 * GIB)
        assert p.serves and p.spec_tokens == 3, p.reasons
    for over, why in (({"cache_config.mamba_block_size": 3}, "could cross two block boundaries"),
                      ({"cache_config.prefix_match_unit": 16}, "prefix_match_unit")):
        p = make_plan(mtp(3, **align, **over), ring, memory_bytes=80 * GIB)
        assert not p.serves and not p.by_choice and any(why in r.text for r in p.reasons), p.reasons
    monkeypatch.setattr(plan, "gdn_prefill_backend", lambda cfg: "flashinfer")
    assert make_plan(mtp(3, **align), ring, memory_bytes=80 * GIB).serves
    p = make_plan(mtp(3, **align), ON, memory_bytes=80 * GIB)
    assert not p.serves and p.by_choice, p.reasons
    text = p.reasons[0].text  # the faked release (0.33) is not among the validated ones
    assert "FlashInfer GDN prefill" in text and "not with 0.33" in text and "vLLM 0.34 " in text, text
    monkeypatch.setattr(plan, "gdn_prefill_backend", lambda cfg: "cutedsl")
    p = make_plan(mtp(3, **align), ring, memory_bytes=80 * GIB)
    assert not p.serves and not p.by_choice and any("cutedsl GDN prefill backend" in r.text for r in p.reasons)
    assert make_plan(mtp(3), ON, memory_bytes=80 * GIB).serves  # without prefix caching: never asked


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_adaptive_verification_keeps_mtp_native(platform, request):
    """vLLM 0.34's adaptive verification trims verify windows on the device after the host
    metadata is built: not validated with the ring, so MTP stays on vLLM's path (a typed reason),
    and the ring's backend tells vLLM it does not take such batches."""
    if platform == "cuda":
        request.getfixturevalue("on_cuda")
    adaptive = mtp(3, **{"speculative_config.enable_adaptive_verification": True})
    p = make_plan(adaptive, ReplayConfig(enable=True, allow_mtp="ring"), memory_bytes=80 * GIB)
    assert not p.serves and not p.by_choice
    assert any(r.kind == UNSUPPORTED and "adaptive verification" in r.text for r in p.reasons), p.reasons
    fixed = mtp(3, **{"speculative_config.enable_adaptive_verification": False})
    assert make_plan(fixed, ReplayConfig(enable=True, allow_mtp="ring"), memory_bytes=80 * GIB).serves

    from replayssm_patch.vllm.gdn_backend import ReplayGDNAttentionBackend

    assert ReplayGDNAttentionBackend.supports_device_cpu_query_lens_mismatch() is False


def test_mtp_stays_native_by_default_where_not_validated_on_cuda(on_cuda, monkeypatch):
    """A release the MTP agreement run has not passed on: MTP native by default, with or without
    prefix caching (an opt-in reason naming the validated releases); the ring when asked for."""
    from replayssm_patch import versions

    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.34.0")
    monkeypatch.setattr(plan, "gdn_prefill_backend", lambda cfg: "triton")
    ring = ReplayConfig(enable=True, allow_mtp="ring")
    for cfg in (mtp(3), mtp(3, **{"cache_config.mamba_cache_mode": "align"})):
        p = make_plan(cfg, ON, memory_bytes=80 * GIB)
        assert not p.serves and p.by_choice, p.reasons
        assert any(r.kind == OPT_IN and "MTP through the ring is validated on CUDA with vLLM 0.33" in r.text
                   and "not with 0.34" in r.text for r in p.reasons), p.reasons
        assert make_plan(cfg, ring, memory_bytes=80 * GIB).serves


def test_mtp_with_prefix_caching_stays_native_by_default_where_not_validated_on_cuda(on_cuda, monkeypatch):
    """A release where MTP is validated but the align GPU test has not passed: MTP with prefix
    caching native by default (an opt-in reason naming the validated releases), the ring when
    asked for; without prefix caching the ring by default."""
    from packaging.version import Version

    from replayssm_patch import versions

    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.34.0")
    monkeypatch.setattr(versions, "MTP_CUDA_VALIDATED", (Version("0.33"), Version("0.34")))
    monkeypatch.setattr(versions, "ALIGN_MTP_CUDA_VALIDATED", (Version("0.33"),))
    monkeypatch.setattr(plan, "gdn_prefill_backend", lambda cfg: "triton")
    align = mtp(3, **{"cache_config.mamba_cache_mode": "align"})
    p = make_plan(align, ON, memory_bytes=80 * GIB)
    assert not p.serves and p.by_choice, p.reasons
    assert any("with prefix caching through the ring is validated on CUDA with vLLM 0.33" in r.text
               and "not with 0.34" in r.text for r in p.reasons), p.reasons
    assert make_plan(align, ReplayConfig(enable=True, allow_mtp="ring"), memory_bytes=80 * GIB).serves
    assert make_plan(mtp(3), ON, memory_bytes=80 * GIB).serves  # without prefix caching


def test_mtp_on_cuda_needs_vllm_032(on_cuda, monkeypatch):
    from replayssm_patch import versions

    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.31.0")
    p = make_plan(mtp(3), ReplayConfig(enable=True, allow_mtp="ring"), memory_bytes=80 * GIB)
    assert not p.serves and "vLLM < 0.32" in p.reasons[0].text


def test_flashinfer_verify_kernel_refused_with_the_reason_or_planned(on_cuda, monkeypatch):
    from replayssm_patch.ring import flashinfer

    bf16 = {"cache_config.mamba_ssm_cache_dtype": "bfloat16"}
    fi = ReplayConfig(enable=True, mtp_kernel="flashinfer")
    for cfg, why in ((mtp(5, **bf16), "serves verify windows of 4 or 8 tokens"), (mtp(3), "needs a bfloat16 SSM state")):
        p = make_plan(cfg, fi, memory_bytes=80 * GIB)
        assert not p.serves and p.reasons[0].text.startswith("mtp_kernel='flashinfer'") and why in p.reasons[0].text
    monkeypatch.setattr(flashinfer, "why_not", lambda *args: None)
    p = make_plan(mtp(3, **bf16), fi, memory_bytes=80 * GIB)
    assert p.serves and p.verify_kernel == "flashinfer" and p.geometry.ring_len == flashinfer.RING_SLOTS
    assert make_plan(mtp(3, **bf16), ON, memory_bytes=80 * GIB).verify_kernel == "triton"


def test_the_rule_keeps_every_calibration_loss_native():
    """No end-to-end cell that measured slower than native would be served by default: every
    such cell's predicted gain is below the rule's threshold (make_plan_tables sets it so)."""
    rule = payoff.tables()["rule"]
    losses = [c for c in rule["calibration"] if c["measured_speedup"] < 1]
    assert losses and max(c["predicted_gain"] for c in losses) < rule["min_predicted_gain"]


def test_plain_decode_rule_on_the_issue_shapes(on_cuda):
    """The plan on (faked) CUDA, fp32 state, an H200's memory at 0.45 (the issue's runs): the
    dense 9B stays native (its predicted gain stays under the threshold), the 4B takes the ring
    from a large batch; where the ring's pages would push concurrency below max_num_seqs (an H100's
    memory, where align mode's two state pages per request already bind) it stays native."""
    half = {"cache_config.gpu_memory_utilization": 0.45}
    nine = make_plan(fake_config("9b", **half), ON, memory_bytes=140 * GIB)
    assert not nine.serves and nine.by_choice and "predicted gain" in nine.reasons[0].text
    four = make_plan(fake_config("4b", **half), ON, memory_bytes=140 * GIB)
    assert four.serves and 64 <= four.min_batch <= 256 and "predicted gain" in four.rationale
    full = make_plan(fake_config("4b", **half), ON, memory_bytes=80 * GIB)
    assert not full.serves and full.by_choice and "would fit" in full.reasons[0].text
    assert make_plan(fake_config("4b", **half), ReplayConfig(enable=True, min_batch=2),
                     memory_bytes=80 * GIB).min_batch == 2  # asked for: served whatever the rule says


def test_gain_grows_with_the_batch_and_the_gdn_share():
    facts = {s: plan.model_facts(fake_config(s), plan.RingGeometry(16, 32, 128, 128, 16, torch.float32, torch.float32),
                                 80 * GIB) for s in SHAPES}
    gains = {s: [payoff.predicted_gain(f, "fp32", "fp32", b) for b in (1, 16, 64, 256)] for s, f in facts.items()}
    for s in ("9b", "4b"):  # dense: the weights read per step do not grow with the batch
        assert gains[s] == sorted(gains[s]), (s, gains[s])
    assert gains["4b"][-1] > gains["9b"][-1]  # fewer weight bytes per step: a larger GDN share
    moe = facts["a3b"]
    assert moe.weight_bytes_read(1) < moe.weight_bytes_read(256) <= moe.weight_bytes  # experts touched


def test_concurrency_estimate_follows_vllms_page_arithmetic():
    """Pages of attention blocks grow with the GDN page; a request takes one GDN page per layer
    (two with align mode) and max_model_len tokens of attention blocks."""
    f = plan.model_facts(fake_config(**{"cache_config.mamba_cache_mode": "none", "model_config.max_model_len": 776,
                                        "cache_config.gpu_memory_utilization": 0.5}),
                         plan.RingGeometry(16, 32, 128, 128, 16, torch.float32, torch.float32), 80 * GIB)
    state = 32 * 128 * 128 * 4 + f.conv_bytes_per_slot
    ring = plan.RingGeometry(16, 32, 128, 128, 16, torch.float32, torch.float32).bytes_per_slot
    native, with_ring = payoff.requests_that_fit(f, state), payoff.requests_that_fit(f, state + ring)
    assert 0.8 < with_ring / native < 0.9  # the ring's pages cost 10-20% of the requests (fp32, L=16)


def test_plan_log_lines_and_strict_mode(on_cuda, monkeypatch, caplog, clean_patch_state):
    """One log line per decision: native by choice at INFO, a limitation as a warning (raised in
    strict mode), a served plan at INFO with its rationale."""
    from replayssm_patch.state import STATE, PatchRefused

    monkeypatch.setattr(model_class, "ensure", lambda cfg, extra, state: (True, ""))
    monkeypatch.setattr(logging.getLogger("vllm.replayssm_patch"), "propagate", True)
    STATE.config = ON
    with caplog.at_level(logging.INFO, logger="vllm.replayssm_patch"):
        assert gdn_layer.plan_for(mtp(7)).serves
        gdn_layer.plan_for(mtp(7))  # logged once
        assert not gdn_layer.plan_for(mtp(7, lora_config=object())).serves
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "vllm.replayssm_patch"]
    served = [m for lvl, m in lines if "decode through the ring on MTP (T=7)" in m]
    assert len(served) == 1 and "one state slot per request" in served[0]
    assert any(lvl == logging.WARNING and "LoRA" in m for lvl, m in lines)
    STATE.config = ReplayConfig(enable=True, strict=True)
    with pytest.raises(PatchRefused, match="LoRA"):
        gdn_layer.plan_for(mtp(3, lora_config=object()))
    STATE.config = ReplayConfig(enable=True, strict=True, allow_mtp="native")
    assert not gdn_layer.plan_for(mtp(3)).serves  # native by choice: never raised, even strict


CAPACITY_RUNS = ("capacity_9b_h100_2026-12-06/capacity_t3.json", "capacity_9b_h100_2026-12-06/capacity_t7.json",
                 "capacity_9b_profile_h100_2026-12-07/capacity_t3.json",
                 "capacity_9b_profile_h100_2026-12-07/capacity_t7.json",
                 "capacity_9b_grouped_h100_2026-12-07/capacity_t3.json",
                 "prefill_group_states_h100_2026-12-07/capacity_t3.json",
                 "capacity_moe_h100_2026-12-06/capacity_t3.json", "capacity_moe_h100_2026-12-06/capacity_t7.json")


@pytest.mark.parametrize("run", CAPACITY_RUNS)
def test_ring_verify_graphs_cover_the_requests_measured_engines_held(run, on_cuda):
    """graph_sizes stops the ring's verify graphs near payoff's estimate of the requests that fit:
    on the configs of the GPU capacity runs (benchmarks/results/), the graphs it would add cover
    every request count the ring engine held there (its maximum concurrency, within max_num_seqs)."""
    import json
    from pathlib import Path

    from replayssm_patch.vllm.graph_sizes import FIT_MARGIN, graphed_requests

    data = json.loads((Path(__file__).parent.parent / "benchmarks" / "results" / run).read_text())
    cfg_run, ring = data["config"], data["engines"]["ring"]
    hf = SimpleNamespace(**data["model_config"])
    T, seqs = cfg_run["mtp"], cfg_run["max_num_seqs"] or 256
    max_model_len = round(ring["kv_cache_tokens"] / ring["max_concurrency"])  # as vLLM's concurrency line counts it
    cfg = mtp(T, **{"model_config.hf_text_config": hf, "model_config.max_model_len": max_model_len,
                    "cache_config.gpu_memory_utilization": cfg_run["gpu_util"], "scheduler_config.max_num_seqs": seqs})
    memory = int(ring["gpu_budget_gib"] / cfg_run["gpu_util"] * GIB)
    p = make_plan(cfg, ON, memory_bytes=memory)
    assert p.serves, p.reasons
    fit = plan.ring_requests_that_fit(cfg, p, memory)
    assert graphed_requests(seqs, fit) >= min(seqs, ring["max_concurrency"]), (fit, ring["max_concurrency"])
    assert fit < 3 * ring["max_concurrency"]  # an estimate, not a bound that never binds
    if "profile" in run or "group" in run:  # engines whose profile held the GDN prefill step back, as the estimate does
        assert ring["max_concurrency"] / FIT_MARGIN <= fit <= ring["max_concurrency"] * FIT_MARGIN, (
            fit, ring["max_concurrency"])


@pytest.mark.parametrize("state", ["fp32", "bf16"])
def test_prefill_step_estimate_covers_the_measured_steps(state):
    """payoff's line for the ring's profiled prefill step meets the measured step at its ends and
    stays at or above it between them (benchmarks/results/gdn_prefill_memory_h100_2026-12-07/)."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent.parent / "benchmarks" / "results" / "gdn_prefill_memory_h100_2026-12-07"
                       / "vllm033" / f"gdn_prefill_memory_{state}.json").read_text())
    g = data["gdn"]
    el = 4 if state == "fp32" else 2
    for row in data["rows"]:
        facts = SimpleNamespace(max_num_batched_tokens=row["tokens"], max_num_seqs=row["seqs"],
                                qkv_bytes_per_token=(2 * g["key_heads"] + g["value_heads"]) * g["head_dim"] * 2,
                                state_bytes_per_slot=g["value_heads"] * g["head_dim"] ** 2 * el)
        estimate = payoff.prefill_step_bytes(facts, state, row["seqs"]) / GIB
        assert row["peak_above_inputs_gib"] - 0.01 <= estimate <= row["peak_above_inputs_gib"] * 1.1, (row, estimate)


def test_ring_fit_holds_the_prefill_step_back_on_cuda_only(on_cuda):
    """On CUDA the ring engine's profile holds back one prefill step of
    max_num_batched_tokens over min(max_num_seqs, tokens) sequences: the estimate of the requests
    that fit drops by that much memory; on CPU nothing is held back."""
    cfg = mtp(3, **{"scheduler_config.max_num_seqs": 512})
    geometry = plan.RingGeometry(16, 32, 128, 128, 16, torch.float32, torch.float32)
    facts = plan.model_facts(cfg, geometry, 80 * GIB)
    page = geometry.state_bytes_per_slot + facts.conv_bytes_per_slot + geometry.bytes_per_slot
    step = payoff.prefill_step_bytes(facts, "fp32", 512)
    assert 3 * GIB < step < 4 * GIB  # 16384 tokens over 512 sequences of the 9B layer, fp32 state
    assert plan._ring_requests_that_fit(facts, geometry, "cuda") == pytest.approx(
        payoff.requests_that_fit(facts, page, step))
    assert plan._ring_requests_that_fit(facts, geometry, "cpu") == pytest.approx(payoff.requests_that_fit(facts, page))
    assert payoff.requests_that_fit(facts, page, step) < payoff.requests_that_fit(facts, page)
    # a speculating engine's step also holds vLLM's copy of the step's q/k/v
    copy = facts.max_num_batched_tokens * facts.qkv_bytes_per_token
    assert payoff.prefill_step_bytes(facts, "fp32", 512, spec_decode=True) == pytest.approx(step + copy)
    assert plan._ring_requests_that_fit(facts, geometry, "cuda", spec_decode=True) == pytest.approx(
        payoff.requests_that_fit(facts, page, step + copy))
