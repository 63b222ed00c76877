"""FlashInfer's ReplaySSM MTP kernel as our verify step (`replayssm_patch.ring.flashinfer`).

`CudaRingOps.verify(..., flashinfer=True)` runs FlashInfer's `gated_delta_rule_mtp_ucache_flush`
on our rings with our commit around it; `flashinfer=False` runs our Triton verify kernel (tested
against a float64 reference in test_ring_verify_gpu.py). Twins fed the same inputs and accepted
counts must agree, over enough steps that both fold rings into checkpoints (at different
points: FlashInfer from 16 - W + 1 committed entries, ours when a window does not fit L = 32):
  * every step's outputs of the real rows;
  * the first window's ring entries written from empty rings (keys, d, log-decays): the
    two kernels keep the same ring content, which is what lets every other ring operation
    stay ours;
  * after the last commit, the materialised checkpoints;
and rows that start with more than 16 committed entries (which FlashInfer does not take) are
folded first. A CUDA graph of FlashInfer steps replays like eager calls on a copy.
Bound: 2e-2 relative, the bf16 verify bound. Skipped without an SM90+ GPU or FlashInfer (the
`flashinfer` extra).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs a CUDA GPU of capability 9.0 or newer", allow_module_level=True)
pytest.importorskip("triton")

from collections import Counter  # noqa: E402

from replayssm_patch.ring import flashinfer as flashinfer_verify  # noqa: E402
from replayssm_patch.ring.runtime import CudaRingOps  # noqa: E402
from replayssm_patch.ops.cursor import unpack_cursor  # noqa: E402

if flashinfer_verify.load_kernel()[0] is None:
    pytest.skip(f"FlashInfer's verify kernel does not import: {flashinfer_verify.load_kernel()[1]}",
                allow_module_level=True)

pytestmark = pytest.mark.gpu

BF16, F32 = torch.bfloat16, torch.float32
BOUND = 2e-2
H, HV, K, V, L = 4, 8, 128, 128, flashinfer_verify.RING_SLOTS
OPS = CudaRingOps(Counter())


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def _paged(slots, shape, dtype):
    """A [slots, *shape] view inside a bigger per-slot page, zero-filled (as vLLM's cache starts)."""
    inner = 1
    for s in shape:
        inner *= s
    return torch.zeros(slots, 64 + inner + 64, dtype=dtype, device="cuda")[:, 64:64 + inner].view(slots, *shape)


def _arm(S0, entries, n0):
    slots = S0.shape[0]
    arm = SimpleNamespace(state=_paged(slots, (HV, V, K), BF16), d=_paged(slots, (HV, L, V), BF16),
                          k=_paged(slots, (H, L, K), BF16), g=_paged(slots, (HV, L), F32))
    arm.state.copy_(S0)
    for t, x in zip((arm.d, arm.k, arm.g), entries):
        t.copy_(x)
    arm.cursor = n0.clone()
    return arm


def _setup(W, seed, n_max):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    B, slots = 7, 12
    real = torch.randperm(slots - 1, generator=gen)[:B - 1] + 1
    idx = torch.cat([real[:3], torch.tensor([-1]), real[3:]]).to(torch.int32).cuda()  # a padding row
    S0 = (torch.randn(slots, HV, V, K, generator=gen) * 0.2).to(BF16)
    entries = ((torch.randn(slots, HV, L, V, generator=gen) * 0.3).to(BF16),
               torch.nn.functional.normalize(torch.randn(slots, H, L, K, generator=gen), dim=-1).to(BF16),
               torch.cumsum(-torch.rand(slots, HV, L, generator=gen) * 0.1, dim=-1))
    n0 = torch.randint(0, n_max + 1, (slots,), generator=gen).to(torch.int32)
    n0[real[0]] = n_max  # at least one row starts with n_max committed entries
    n0 = n0.cuda()
    # as vLLM's layer holds them: parameters that require grad, dt_bias in the model dtype
    params = (torch.nn.Parameter((torch.randn(HV, generator=gen) * 0.5).cuda()),
              torch.nn.Parameter((torch.randn(HV, generator=gen) * 0.5).to(BF16).cuda()))
    return gen, idx, S0, entries, n0, params


def _step_inputs(gen, B, W):
    qkv = torch.randn(B * W, 2 * H * K + HV * V, generator=gen).to(BF16).cuda()
    a = torch.randn(B * W, HV, generator=gen).to(BF16).cuda()
    b = torch.randn(B * W, HV, generator=gen).to(BF16).cuda()
    return qkv, a, b


@pytest.mark.parametrize("W,n_max", [(4, 0), (8, 0), (4, 24), (8, 24)])
def test_flashinfer_verify_matches_ours(W, n_max):
    gen, idx, S0, entries, n0, (A_log, dt_bias) = _setup(W, 10 * W + n_max, n_max)
    ours, fi = _arm(S0, entries, n0), _arm(S0, entries, n0)
    B = idx.shape[0]
    real = idx > 0
    s = idx[real].long()
    cu = torch.arange(0, B * W + 1, W, dtype=torch.int32, device="cuda")
    acc = torch.ones(B, dtype=torch.int32, device="cuda")
    steps, worst, folds = 3 * 16 // W + 2, 0.0, 0
    for step in range(steps):
        qkv, a, b = _step_inputs(gen, B, W)
        outs = []
        for arm, use_fi in ((ours, False), (fi, True)):
            before = unpack_cursor(arm.cursor[s])[0].clone() if use_fi else None
            out = torch.full((B * W, HV, V), float("nan"), dtype=BF16, device="cuda")
            OPS.verify(qkv, a, b, A_log, dt_bias, K ** -0.5, arm.state, out, idx, cu, arm, acc, W,
                                flashinfer=use_fi)
            outs.append(out.view(B, W, HV, V)[real])
        n_fi, pending = unpack_cursor(fi.cursor[s])
        assert (pending == W).all(), "the window is not marked pending"
        folds += int((n_fi == 0).sum()) if step else 0
        err = _rel(outs[1], outs[0])
        worst = max(worst, err)
        assert torch.isfinite(outs[1]).all() and err < BOUND, f"step {step}: outputs differ by {err:.3e}"
        if step == 0 and n_max == 0:  # both wrote the first window at 0..W-1 of empty rings
            for name, x, y in (("k", fi.k, ours.k), ("d", fi.d, ours.d), ("g", fi.g, ours.g)):
                e = _rel(x[s, :, :W], y[s, :, :W])
                print(f"W={W}: first window's {name} entries differ by {e:.3e}")
                assert e < BOUND, f"first window's {name} entries differ by {e:.3e}"
        if step == 0 and n_max > 16:  # rows past FlashInfer's 16 entries were folded first
            assert before.max() > 16 and (n_fi[before > 16] == 0).all()
        acc = torch.randint(1, W + 1, (B,), generator=gen, dtype=torch.int32).cuda()
    assert folds > 0, "no row folded its ring: the test did not cover it"
    for arm in (ours, fi):
        OPS.commit(arm, idx, acc)
        OPS.materialize(arm.state, arm, idx)
    err = _rel(fi.state[s], ours.state[s])
    print(f"W={W} n_max={n_max}: {steps} steps, {folds} folds, worst output diff {worst:.3e}, state diff {err:.3e}")
    assert err < BOUND, f"materialised checkpoints differ by {err:.3e}"


def test_flashinfer_verify_cuda_graph_replays_like_eager():
    W = 4
    gen, idx, S0, entries, n0, (A_log, dt_bias) = _setup(W, 3, 8)
    graph_arm, eager_arm = _arm(S0, entries, n0), _arm(S0, entries, n0)
    B = idx.shape[0]
    cu = torch.arange(0, B * W + 1, W, dtype=torch.int32, device="cuda")
    steps = [(*_step_inputs(gen, B, W), torch.randint(1, W + 1, (B,), generator=gen, dtype=torch.int32).cuda())
             for _ in range(6)]
    static = [tuple(t.clone() for t in st) for st in steps]
    outs = [torch.empty(B * W, HV, V, dtype=BF16, device="cuda") for _ in steps]

    def run(arm, inputs, outputs):
        for (qkv, a, b, acc), out in zip(inputs, outputs):
            OPS.verify(qkv, a, b, A_log, dt_bias, K ** -0.5, arm.state, out, idx, cu, arm, acc, W,
                                flashinfer=True)

    warm = _arm(S0, entries, n0)  # compile outside the capture, on a throwaway copy
    run(warm, static, [torch.empty_like(o) for o in outs])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(graph_arm, static, outs)
    g.replay()
    eager_outs = [torch.empty_like(o) for o in outs]
    run(eager_arm, steps, eager_outs)
    torch.cuda.synchronize()
    real = (idx > 0).repeat_interleave(W)
    for i, (x, y) in enumerate(zip(outs, eager_outs)):
        assert torch.equal(x[real], y[real]), f"step {i}: graph replay differs from eager"
    for name in ("state", "d", "k", "g", "cursor"):
        x, y = getattr(graph_arm, name), getattr(eager_arm, name)
        sl = idx[idx > 0].long()
        assert torch.equal(x[sl], y[sl]), f"{name} differs between graph replay and eager"
