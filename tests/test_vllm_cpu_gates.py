"""vLLM's CPU GDN kernels, measured: how they round, and that the CPU ring path computes the
same recurrence.

vLLM's CPU decode kernel (`fused_sigmoid_gating_delta_rule_update_cpu`) computes the write
gate beta = sigmoid(b) stepwise in b's dtype (bf16: exp, 1 + e and the reciprocal each rounded),
its MTP kernel (`..._spec_cpu`) in fp32; the decay alpha in fp32 in both; and both L2-normalise
q / k with eps 1e-5 (the CUDA kernels: 1e-6). An fp32 beta differs from the decode kernel's by
up to one bf16 step (4e-3 relative) per token and the eps by 7e-4 at the |k| of the test
checkpoints: together what made patched-vs-native tokens drift on CPU. The CPU ring's step is
therefore the kernel's own, taken from the replayed state (replayssm_patch.ring.cpu), and the
entries it appends round as the kernel does (numerics.KernelNumerics). These tests read the
rounding straight out of the real kernels, so a vLLM release that changes it fails here.

Real vLLM (CPU build) is needed: skipped without it, failed under CI.
"""

from __future__ import annotations

import pytest
import torch

from replayssm_patch.ops.gdn_reference import CPU_L2NORM_EPS, stepwise_sigmoid
from replayssm_patch.ops.decode_reference import ring_decode_reference
from replayssm_patch.testing import require_vllm

pytestmark = pytest.mark.vllm
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def ops():
    """The module holding vLLM's CPU GDN kernels (vllm._custom_ops; vllm._cpu_ops from 0.34)."""
    require_vllm()
    import importlib

    from replayssm_patch import versions

    return importlib.import_module(versions.capabilities().cpu_ops_module)


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm())


def _beta_probe(ops, spec: bool, seed: int):
    """Run one token per row with S0 = 0, k = e_0, v = 1 and alpha = 1, so the new state's
    [0][0] entry (the CPU kernels' [K, V] view) is |k|_normalised * beta: beta read back."""
    H = HV = 32
    K = V = 16
    N = 48
    g = torch.Generator().manual_seed(seed)
    b = (torch.randn(N, HV, generator=g) * 4).to(BF16)
    a = torch.zeros(N, HV, dtype=BF16)
    q = torch.randn(1, N, H, K, generator=g).to(BF16)
    k = torch.zeros(1, N, H, K, dtype=BF16)
    k[..., 0] = 1
    v = torch.ones(1, N, HV, V, dtype=BF16)
    A_log = torch.full((HV,), -30.0)  # exp(A_log) ~ 1e-13: g ~ 0, alpha = 1
    dt_bias = torch.zeros(HV, dtype=BF16)
    state = torch.full((N + 1, HV, K, V), float("nan"))
    state[1:] = 0
    slots = torch.arange(1, N + 1, dtype=torch.int32)
    cu = torch.arange(N + 1, dtype=torch.int32)
    if spec:
        ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
            A_log=A_log, dt_bias=dt_bias, q=q[0], k=k[0], v=v[0], a=a, b=b, initial_state_source=state,
            spec_state_indices=slots[:, None], num_accepted_tokens=torch.ones(N, dtype=torch.int32),
            cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    else:
        ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=state,
            initial_state_indices=slots, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    k_norm = 1.0 / (1.0 + CPU_L2NORM_EPS) ** 0.5
    return b, state[1:, :, 0, 0].double() / k_norm


def _max_rel(x, ref):
    return float(((x.double() - ref.double()).abs() / ref.double().abs()).max())


def test_cpu_decode_kernel_computes_beta_stepwise_in_bf16(ops):
    b, beta = _beta_probe(ops, spec=False, seed=0)
    stepwise = _max_rel(beta, stepwise_sigmoid(b, BF16))
    fp32 = _max_rel(beta, torch.sigmoid(b.float()))
    print(f"decode kernel beta: stepwise-bf16 max rel diff {stepwise:.2e}, fp32 sigmoid {fp32:.2e}")
    assert stepwise < 1e-6, stepwise
    assert fp32 > 1e-3, fp32  # the two are told apart: an fp32 beta is off by up to a bf16 step


def test_cpu_spec_kernel_computes_beta_in_fp32(ops):
    b, beta = _beta_probe(ops, spec=True, seed=1)
    fp32 = _max_rel(beta, torch.sigmoid(b.float()))
    stepwise = _max_rel(beta, stepwise_sigmoid(b, BF16))
    print(f"spec kernel beta: fp32 sigmoid max rel diff {fp32:.2e}, stepwise-bf16 {stepwise:.2e}")
    assert fp32 < 1e-6, fp32
    assert stepwise > 1e-3, stepwise


@pytest.mark.parametrize("spec", [False, True], ids=["decode", "spec"])
def test_cpu_kernels_normalise_with_eps_1e5(ops, spec):
    """k = 0.01 e_0 (|k|^2 = 1e-4, where the eps shows), beta = 1, S0 = 0, v = 1: the new
    state's [0][0] entry is k's normalised first element."""
    H = HV = 8
    K = V = 16
    N = 4
    k = torch.zeros(1, N, H, K, dtype=BF16)
    k[..., 0] = 0.01
    q = torch.randn(1, N, H, K, generator=torch.Generator().manual_seed(3)).to(BF16)
    v = torch.ones(1, N, HV, V, dtype=BF16)
    b = torch.full((N, HV), 30.0).to(BF16)  # beta = 1 in every rounding
    common = dict(A_log=torch.full((HV,), -30.0), dt_bias=torch.zeros(HV, dtype=BF16),
                  a=torch.zeros(N, HV, dtype=BF16), b=b, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=torch.arange(N + 1, dtype=torch.int32))
    state = torch.zeros(N + 1, HV, K, V)
    slots = torch.arange(1, N + 1, dtype=torch.int32)
    if spec:
        ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
            q=q[0], k=k[0], v=v[0], initial_state_source=state, spec_state_indices=slots[:, None],
            num_accepted_tokens=torch.ones(N, dtype=torch.int32), **common)
    else:
        ops.fused_sigmoid_gating_delta_rule_update_cpu(
            q=q, k=k, v=v, initial_state_source=state, initial_state_indices=slots, **common)
    x = float(k[0, 0, 0, 0])
    got = state[1:, :, 0, 0].double()
    want = {eps: x / (x * x + eps) ** 0.5 for eps in (1e-6, CPU_L2NORM_EPS)}
    print(f"normalised k: kernel {float(got[0, 0]):.7f}, eps 1e-6 {want[1e-6]:.7f}, eps 1e-5 {want[1e-5]:.7f}")
    assert float((got - want[CPU_L2NORM_EPS]).abs().max()) < 1e-6
    assert abs(want[1e-6] - want[CPU_L2NORM_EPS]) > 1e-2


def test_ring_reference_step_matches_cpu_decode_kernel(ops):
    """One decode step from random states (empty rings, so the ring runs the plain step), with
    small |q|, |k| as the test checkpoints have: the ring rounding as the kernel does matches
    vLLM's CPU kernel to fp32 rounding; with the CUDA kernels' rounding it is 1e-3 away."""
    H, HV, K, V, N, slots = 2, 4, 128, 128, 3, 5
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(1, N, H, K, generator=g) * 0.01).to(BF16)
    k = (torch.randn(1, N, H, K, generator=g) * 0.01).to(BF16)
    v = torch.randn(1, N, HV, V, generator=g).to(BF16)
    a = torch.randn(N, HV, generator=g).to(BF16)
    b = torch.randn(N, HV, generator=g).to(BF16)
    A_log = torch.randn(HV, generator=g) * 0.5
    dt_bias = (torch.randn(HV, generator=g) * 0.5).to(BF16)
    S0 = torch.randn(slots, HV, V, K, generator=g) * 0.2  # the ring's [V, K] layout
    idx = torch.tensor([1, 3, 4], dtype=torch.int32)

    native_state = S0.transpose(-1, -2).contiguous()  # the CPU kernels' [K, V] view
    native_out = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=native_state,
        initial_state_indices=idx, cu_seqlens=torch.arange(N + 1, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True)
    mixed = torch.cat([q[0].reshape(N, -1), k[0].reshape(N, -1), v[0].reshape(N, -1)], dim=-1)
    errs = {}
    for name, rounding, eps in (("cpu", BF16, CPU_L2NORM_EPS), ("cuda", None, 1e-6)):
        state = S0.clone()
        L = 4
        rings = (torch.zeros(slots, HV, L, V), torch.zeros(slots, H, L, K), torch.zeros(slots, HV, L),
                 torch.zeros(slots, dtype=torch.int32))
        out = torch.full((N, HV, V), float("nan"), dtype=BF16)
        force = torch.ones(N, dtype=torch.bool)  # flush: the step's state lands in the checkpoint
        ring_decode_reference(mixed, a, b, A_log, dt_bias, K ** -0.5, state, out, idx, *rings,
                              force_flush=force, beta_rounding=rounding, l2norm_eps=eps)
        errs[name] = (_rel(state[idx.long()], native_state[idx.long()].transpose(-1, -2)),
                      _rel(out, native_out.view(N, HV, V)))
    print("ring vs vLLM CPU kernel (state rel, out rel):", errs)
    assert errs["cpu"][0] < 1e-6, errs
    assert errs["cpu"][1] < 2e-4, errs  # bf16 outputs: a few one-ulp flips at most
    assert errs["cuda"][0] > 1e-4, errs


@pytest.mark.parametrize("L", [1, 4, 16])
def test_cpu_ring_step_is_the_kernels_step(ops, L):
    """replayssm_patch.ring.cpu against vLLM's CPU decode kernel over 20 steps from random
    states (GQA 3, two of five slots idle, rings poisoned past their cursors): at ring length 1
    (a flush every step) outputs and states are bit-identical; longer rings differ only by the
    replay's rounding, and the checkpoint of a row that flushes is the kernel's own new state."""
    from replayssm_patch.ring import cpu as cpu_ring
    from replayssm_patch.ring.runtime import RingBuffers

    H, HV, K, V, N, slots = 2, 6, 128, 128, 3, 6
    g = torch.Generator().manual_seed(10 + L)
    A_log = torch.randn(HV, generator=g) * 0.5
    dt_bias = (torch.randn(HV, generator=g) * 0.5).to(BF16)
    S0 = torch.randn(slots, HV, K, V, generator=g) * 0.2  # the kernel's [K, V] view
    idx = torch.tensor([1, 3, 4], dtype=torch.int32)
    native_state, ring_state = S0.clone(), S0.clone()
    nan = float("nan")
    ring = RingBuffers(g=torch.full((slots, HV, L), nan), d=torch.full((slots, HV, L, V), nan),
                       k=torch.full((slots, H, L, K), nan), cursor=torch.zeros(slots, dtype=torch.int32))
    worst, identical = 0.0, 0
    for _ in range(20):
        inputs = dict(q=torch.randn(1, N, H, K, generator=g).to(BF16), k=torch.randn(1, N, H, K, generator=g).to(BF16),
                      v=torch.randn(1, N, HV, V, generator=g).to(BF16), a=torch.randn(N, HV, generator=g).to(BF16),
                      b=torch.randn(N, HV, generator=g).to(BF16), A_log=A_log, dt_bias=dt_bias,
                      initial_state_indices=idx, cu_seqlens=torch.arange(N + 1, dtype=torch.int32),
                      use_qk_l2norm_in_kernel=True)
        want = ops.fused_sigmoid_gating_delta_rule_update_cpu(initial_state_source=native_state, **inputs)
        got = cpu_ring.ring_decode(ops.fused_sigmoid_gating_delta_rule_update_cpu,
                                   dict(inputs, initial_state_source=ring_state), ring, None, None)
        identical += bool(torch.equal(got, want))
        worst = max(worst, _rel(got, want))
        flushed = idx[ring.cursor[idx.long()] == 0].long()
        if L == 1:
            assert torch.equal(ring_state[flushed], native_state[flushed])
    for s in (0, 2, 5):  # idle slots untouched
        assert torch.equal(ring_state[s], S0[s])
    print(f"L={L}: {identical}/20 steps bit-identical, worst relative output difference {worst:.2e}")
    if L == 1:
        assert identical == 20
    else:
        assert worst < 2e-3 and identical >= 5  # bf16 output flips from the replay's rounding only
