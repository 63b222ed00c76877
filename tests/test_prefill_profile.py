"""The GDN prefill step a ring layer adds to vLLM's memory profile (vllm.prefill_profile, issue 46).

vLLM's profile forward skips the GDN core, so a prefill step's temporaries were held beyond the
engine's budget. A ring layer on CUDA runs, once, in that forward, the worst step the scheduler may
send: the profile's tokens over min(max_num_seqs, tokens) sequences through the layer's own prefill
op. On CPU the step is checked against a prefill op that records what it is given (and computes
the recurrence with the package's float64 reference); its memory is measured on the GPU
(benchmarks/gdn_prefill_memory.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from replayssm_patch.plan import Plan, RingGeometry
from replayssm_patch.testing.reference_prefill import ReferencePrefill
from replayssm_patch.vllm import prefill_profile

if not os.environ.get("CI"):
    pytest.importorskip("vllm")

from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention  # noqa: E402

from replayssm_patch.vllm.gdn_layer import ReplayQwenGDN  # noqa: E402

HK, HV, D = 2, 4, 8


@pytest.mark.parametrize("tokens,seqs,state_dtype", [(37, 5, torch.float32), (12, 12, torch.bfloat16),
                                                      (9, 1, torch.float32)])
def test_the_step_spreads_the_tokens_over_the_sequences_with_their_states(tokens, seqs, state_dtype):
    gen = torch.Generator().manual_seed(tokens * 31 + seqs)
    qkv = torch.randn(tokens, (2 * HK + HV) * D, generator=gen).to(torch.bfloat16)
    chunk = ReferencePrefill()
    prefill_profile.prefill_step(chunk, qkv, (HK, HV), (HV, D, D), state_dtype, seqs)
    (call,) = chunk.calls
    lens = (call["cu_seqlens"][1:] - call["cu_seqlens"][:-1]).tolist()
    assert call["cu_seqlens"].dtype == torch.int32 and call["cu_seqlens"][0] == 0
    assert len(lens) == seqs and sum(lens) == tokens and max(lens) - min(lens) <= 1 and min(lens) >= 1
    assert call["q"].shape == call["k"].shape == (1, tokens, HK, D) and call["v"].shape == (1, tokens, HV, D)
    assert call["q"].dtype == call["v"].dtype == qkv.dtype
    assert call["g"].shape == call["beta"].shape == (1, tokens, HV) and call["g"].dtype == torch.float32
    assert call["initial_state"].shape == (seqs, HV, D, D) and call["initial_state"].dtype == state_dtype
    assert call["output_final_state"] and call["l2norm"] is False
    # q and k as vLLM's post-conv prep gives them: unit vectors per head (the kernel's l2norm off)
    norms = call["k"].float().norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)
    # v is the qkv's value part, unchanged
    assert torch.equal(call["v"].reshape(tokens, -1), qkv[:, 2 * HK * D:])


def test_the_profile_spreads_over_every_sequence_vllm_may_schedule():
    assert prefill_profile.profile_seqs(16384, 512) == 512
    assert prefill_profile.profile_seqs(100, 512) == 100
    assert prefill_profile.profile_seqs(8192, 1) == 1
    assert prefill_profile.seq_lens(10, 4) == [3, 3, 2, 2]


GEOMETRY = RingGeometry(HK, HV, D, D, 4, torch.float32, torch.float32)


def profile_layer(platform: str, serves: bool = True, backend: str = "triton", max_num_seqs: int = 3):
    """The real layer class built without vLLM's __init__, with what the profile step reads."""
    layer = ReplayQwenGDN.__new__(ReplayQwenGDN)
    torch.nn.Module.__init__(layer)
    layer.ring_plan = Plan(platform, GEOMETRY if serves else None, min_batch=1)
    layer.ring_max_num_seqs = max_num_seqs
    layer.num_k_heads, layer.num_v_heads, layer.tp_size = 2 * HK, 2 * HV, 2  # this rank: HK, HV
    layer.gdn_prefill_backend = backend
    layer.get_state_shape = lambda: ((3, 14), (HV, D, D))
    layer.get_state_dtype = lambda: (torch.bfloat16, torch.float32)
    layer.chunk_gated_delta_rule = ReferencePrefill()
    return layer


@pytest.fixture
def vllm_warmup(monkeypatch):
    """vLLM's warmup (0.33+), recorded: once per layer, by the layer's flag, as vLLM's."""
    calls = []

    def warmup(self, qkv_or_qkvz, v_dim):
        if getattr(self, "_prefill_kernels_warmed_up", False):
            return
        self._prefill_kernels_warmed_up = True
        calls.append(qkv_or_qkvz.shape)

    monkeypatch.setattr(QwenGatedDeltaNetAttention, "_warmup_prefill_kernels", warmup, raising=False)
    return calls


def test_a_cuda_ring_layer_profiles_one_whole_prefill_step_once(vllm_warmup, clean_patch_state, monkeypatch):
    peaks = iter([10 << 30, 12.5 * (1 << 30)])  # the profile's peak before and after the step
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: next(peaks))
    layer = profile_layer("cuda")
    z = 5  # the output gate's columns, which 0.34's fused paths pass along (v_dim)
    qkvz = torch.randn(20, (2 * HK + HV) * D + z).to(torch.bfloat16)
    layer._warmup_prefill_kernels(qkvz, z)
    layer._warmup_prefill_kernels(qkvz, z)  # vLLM warms up once; so does the profile step
    assert len(vllm_warmup) == 1
    (call,) = layer.chunk_gated_delta_rule.calls
    assert call["initial_state"].shape == (3, HV, D, D)  # min(max_num_seqs, 20 tokens) sequences
    assert call["cu_seqlens"].tolist() == [0, 7, 14, 20]
    assert torch.equal(call["v"].reshape(20, -1), qkvz[:, 2 * HK * D:(2 * HK + HV) * D])  # z left out
    assert any("GDN prefill step of 20 tokens over 3 sequences" in m and "raised the profile's peak by 2.50 GiB" in m
               for m in clean_patch_state.logged)


@pytest.mark.parametrize("platform,serves", [("cpu", True), ("cuda", False)])
def test_no_profile_step_off_cuda_or_off_the_ring(platform, serves, vllm_warmup, clean_patch_state):
    layer = profile_layer(platform, serves=serves)
    layer._warmup_prefill_kernels(torch.randn(20, (2 * HK + HV) * D), 0)
    assert len(vllm_warmup) == 1 and not layer.chunk_gated_delta_rule.calls


def test_a_prefill_backend_whose_op_needs_step_metadata_is_named(vllm_warmup, clean_patch_state):
    layer = profile_layer("cuda", backend="cutedsl")
    layer._warmup_prefill_kernels(torch.randn(20, (2 * HK + HV) * D), 0)
    assert not layer.chunk_gated_delta_rule.calls
    assert any("cutedsl prefill backend" in m for m in clean_patch_state.logged)


def test_an_op_that_refuses_the_step_leaves_the_profile_as_vllm_made_it(vllm_warmup, clean_patch_state):
    """The engine starts as vLLM would, with a warning naming the failure; an out-of-memory error
    is raised (the budget could not hold such a step while serving either)."""
    layer = profile_layer("cuda")

    def refuses(**kwargs):
        raise RuntimeError("shape not supported")

    layer.chunk_gated_delta_rule = refuses
    layer._warmup_prefill_kernels(torch.randn(20, (2 * HK + HV) * D), 0)
    assert any("prefill op failed on it (RuntimeError: shape not supported)" in m for m in clean_patch_state.logged)

    def out_of_memory(**kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    layer = profile_layer("cuda")
    layer.chunk_gated_delta_rule = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        layer._warmup_prefill_kernels(torch.randn(20, (2 * HK + HV) * D), 0)


def test_a_layer_that_groups_its_prefill_profiles_the_grouped_step(vllm_warmup, clean_patch_state, monkeypatch):
    from replayssm_patch.vllm import prefill_groups

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    monkeypatch.setattr(prefill_groups, "fla_chunk_size", lambda: 64)
    layer = profile_layer("cuda", max_num_seqs=70)
    op = layer.chunk_gated_delta_rule
    layer.chunk_gated_delta_rule = prefill_groups.GroupedPrefillOp(op, lambda: None)
    layer._warmup_prefill_kernels(torch.randn(300, (2 * HK + HV) * D).to(torch.bfloat16), 0)
    assert [c["initial_state"].shape[0] for c in op.calls] == [prefill_groups.GROUP_SEQS, 70 - prefill_groups.GROUP_SEQS]
    assert any("300 tokens over 70 sequences (triton prefill, per group of at most" in m
               for m in clean_patch_state.logged)


def live_tensors_shaped_as(t: torch.Tensor) -> int:
    """How many distinct tensors of `t`'s shape and dtype are alive now."""
    import gc

    return len({o.data_ptr() for o in gc.get_objects()
                if type(o) is torch.Tensor and o.shape == t.shape and o.dtype == t.dtype})


@pytest.mark.parametrize("grouped", [False, True])
def test_a_speculating_engines_step_keeps_its_copy_of_the_prefill_tokens(grouped):
    """Beside verify rows, vLLM's core first copies the prefill tokens' q/k/v out of the step's
    (index_select) and keeps the copy to the end: the step of a speculating engine holds one more
    tensor of the input's size while the op runs."""
    qkv = torch.randn(300, (2 * HK + HV) * D).to(torch.bfloat16)
    seen = {}
    for spec in (False, True):
        op = ReferencePrefill()

        def counting(**kw):
            seen.setdefault(spec, live_tensors_shaped_as(qkv))
            return op(**kw)

        prefill_profile.prefill_step(counting, qkv, (HK, HV), (HV, D, D), torch.float32, 70,
                                     64 if grouped else None, spec_decode=spec)
    assert seen[True] == seen[False] + 1


def test_a_speculating_ring_layer_profiles_the_speculating_step(vllm_warmup, clean_patch_state, monkeypatch):
    seen = []
    monkeypatch.setattr(prefill_profile, "prefill_step", lambda *a, **kw: seen.append(kw["spec_decode"]))
    for spec_tokens in (0, 3):
        layer = profile_layer("cuda")
        layer.ring_plan = Plan("cuda", GEOMETRY, min_batch=1, spec_tokens=spec_tokens)
        layer._warmup_prefill_kernels(torch.randn(20, (2 * HK + HV) * D).to(torch.bfloat16), 0)
    assert seen == [False, True]


@pytest.mark.parametrize("platform,backend,chunk_metadata,grouped", [
    ("cuda", "triton", True, True), ("cuda", "flashinfer", True, False), ("cuda", "triton", False, False),
    ("cpu", "triton", True, False)])
def test_which_ring_layers_group_their_prefill(platform, backend, chunk_metadata, grouped, monkeypatch):
    from dataclasses import replace

    from replayssm_patch import versions

    caps = versions.capabilities()
    monkeypatch.setattr(versions, "capabilities", lambda: replace(caps, gdn_chunk_metadata=chunk_metadata))
    layer = profile_layer(platform, backend=backend)
    assert layer._groups_prefill() == grouped


def test_the_profile_step_is_logged_once_for_the_process(vllm_warmup, clean_patch_state, monkeypatch):
    """Every ring layer profiles its step; the first one's line says what it raised the peak by,
    the others' (whose steps fit under that peak) add no line of their own."""
    peaks = iter([10 << 30, 11 << 30, 11 << 30, 11 << 30])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: next(peaks))
    for _ in range(2):
        profile_layer("cuda")._warmup_prefill_kernels(torch.randn(20, (2 * HK + HV) * D).to(torch.bfloat16), 0)
    lines = [m for m in clean_patch_state.logged if "GDN prefill step of" in m]
    assert len(lines) == 1 and "raised the profile's peak by 1.00 GiB" in lines[0]


@pytest.mark.parametrize("platform,backend,validated,cache_mode,on_pool", [
    ("cuda", "flashinfer", True, "none", True), ("cuda", "flashinfer", False, "none", False),
    ("cuda", "flashinfer", True, "align", False), ("cuda", "triton", True, "none", False),
    ("cpu", "flashinfer", True, "none", False)])
def test_which_ring_layers_run_their_prefill_on_the_pool(platform, backend, validated, cache_mode, on_pool,
                                                         monkeypatch):
    from types import SimpleNamespace

    from replayssm_patch import versions
    from replayssm_patch.vllm import flashinfer_pool_prefill

    monkeypatch.setattr(flashinfer_pool_prefill, "flashinfer_takes_pool", lambda: True)
    monkeypatch.setattr(versions, "FLASHINFER_POOL_PREFILL_VALIDATED",
                        (versions.installed_base_version(),) if validated else ())
    layer = profile_layer(platform, backend=backend)
    layer.ring_cache_config = SimpleNamespace(mamba_cache_mode=cache_mode)
    assert layer._pool_prefill() == on_pool
    layer.ring_plan = Plan(platform, None, min_batch=1)  # a native layer
    assert not layer._pool_prefill()


def test_a_layer_that_runs_its_prefill_on_the_pool_profiles_that_step(vllm_warmup, clean_patch_state, monkeypatch):
    from replayssm_patch.vllm import flashinfer_pool_prefill

    seen = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    monkeypatch.setattr(flashinfer_pool_prefill, "run", lambda *a, **kw: seen.append(kw) or torch.zeros(1))
    layer = profile_layer("cuda", backend="flashinfer", max_num_seqs=5)
    layer.chunk_gated_delta_rule = flashinfer_pool_prefill.PoolPrefillOp(layer.chunk_gated_delta_rule, lambda: None,
                                                                         exps_gate=False)
    layer._warmup_prefill_kernels(torch.randn(20, (2 * HK + HV) * D).to(torch.bfloat16), 0)
    (call,) = seen
    assert call["exps_gate"] is False and call["states"].shape == (1, HV, D, D) and call["state_indices"].shape == (5,)
    assert any("20 tokens over 5 sequences (flashinfer prefill, on the state pool in place)" in m
               for m in clean_patch_state.logged)
