"""GPU tests of the ring's operations the integration calls (ring.runtime): `CudaRingOps` runs the
Triton kernels, `CpuRingOps` the torch reference. The same inputs through both (CUDA tensors and
their CPU copies) must agree over whole ring cycles, with forced flushes, rows that start
empty, null and padded rows; and CUDA must refuse the CPU kernels' numerics before it counts
or runs anything.

    python3 -m pytest -q tests/gpu/test_kernels_wrapper_gpu.py
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from collections import Counter  # noqa: E402

from replayssm_patch.ring import numerics  # noqa: E402
from replayssm_patch.ring.runtime import CpuRingOps, CudaRingOps  # noqa: E402
from replayssm_patch.ops.cursor import pack_cursor, unpack_cursor  # noqa: E402

pytestmark = pytest.mark.gpu
STATS = Counter()
GPU, CPU = CudaRingOps(STATS), CpuRingOps(STATS)

H, HV, K, V, L = 2, 6, 128, 128, 16  # GQA 3; the wrapper's defaults for every launch choice


def _rel(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def _twins(seed, slots, ring_dtype, cursor):
    """(CUDA ring + state, CPU copies): an fp32 checkpoint and random ring entries at every
    position (the kernel tests poison the entries past the cursor; here both paths read the
    same values)."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(slots, HV, V, K, generator=gen) * 0.2
    d = (torch.randn(slots, HV, L, V, generator=gen) * 0.3).to(ring_dtype)
    k = torch.nn.functional.normalize(torch.randn(slots, H, L, K, generator=gen), dim=-1).to(ring_dtype)
    g = torch.cumsum(-torch.rand(slots, HV, L, generator=gen) * 0.2, dim=-1)
    cpu = SimpleNamespace(d=d, k=k, g=g, cursor=cursor.clone())
    gpu = SimpleNamespace(d=d.cuda(), k=k.cuda(), g=g.cuda(), cursor=cursor.cuda())
    return (state.cuda(), gpu), (state.clone(), cpu), gen


def _inputs(gen, ntok):
    qkv = torch.randn(ntok, 2 * H * K + HV * V, generator=gen).to(torch.bfloat16)
    a = torch.randn(ntok, HV, generator=gen).to(torch.bfloat16)
    b = torch.randn(ntok, HV, generator=gen).to(torch.bfloat16)
    return qkv, a, b


@pytest.mark.parametrize("ring_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 300])  # the fused launch and the two-phase launches
def test_decode_cuda_matches_cpu_reference(ring_dtype, rows):
    slots = rows + 3
    cursor = (torch.arange(slots) % L).to(torch.int32)  # every cursor position in the batch
    (st_g, ring_g), (st_c, ring_c), gen = _twins(rows, slots, ring_dtype, cursor)
    idx = torch.randperm(slots - 1, generator=gen)[:rows].add(1).to(torch.int32)
    idx[1], idx[-1] = 0, -1  # a NULL-block row and a padded row
    A_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV, generator=gen) * 0.5
    worst = 0.0
    before = dict(STATS)
    for step in range(L + 4):
        qkv, a, b = _inputs(gen, rows)
        ff = torch.rand(rows, generator=gen) < 0.1
        se = torch.rand(rows, generator=gen) < 0.05
        out_c = torch.full((rows, HV, V), float("nan"), dtype=torch.bfloat16)
        out_g = out_c.cuda()
        GPU.decode(qkv.cuda(), a.cuda(), b.cuda(), A_log.cuda(), dt_bias.cuda(), K ** -0.5, st_g, out_g,
                       idx.cuda(), ring_g, ff.cuda(), se.cuda())
        CPU.decode(qkv, a, b, A_log, dt_bias, K ** -0.5, st_c, out_c, idx, ring_c, ff, se,
                       numerics=numerics.FLA_NUMERICS)
        assert not torch.isnan(out_g.float()).any(), f"step {step}: unwritten output"
        assert (out_g[idx.cuda() <= 0] == 0).all(), "null / padded rows get a zero output"
        assert torch.equal(ring_g.cursor.cpu(), ring_c.cursor), f"step {step}: cursors differ"
        worst = max(worst, _rel(out_g, out_c))
    bound = 2e-3 if ring_dtype == torch.float32 else 2e-2  # bf16 output; a bf16 ring d entry may round apart
    assert worst < bound, f"output rel {worst} >= {bound}"
    assert _rel(st_g, st_c) < bound / 2, f"state rel {_rel(st_g, st_c)}"
    assert STATS["decode_calls"] - before.get("decode_calls", 0) == 2 * (L + 4)


def test_spec_verify_cuda_matches_cpu_reference():
    rows, T, slots = 6, 3, 12
    W = T + 1
    n0 = torch.randint(0, L - W + 1, (slots,), generator=torch.Generator().manual_seed(3)).to(torch.int32)
    (st_g, ring_g), (st_c, ring_c), gen = _twins(7, slots, torch.float32, pack_cursor(n0, torch.zeros_like(n0)))
    idx = (torch.randperm(slots - 1, generator=gen)[:rows] + 1).to(torch.int32)
    idx[2] = 0
    A_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV, generator=gen) * 0.5
    last = torch.zeros(rows, dtype=torch.long)
    worst = 0.0
    for step in range(10):
        Ts = torch.randint(1, W + 1, (rows,), generator=gen)
        acc = torch.where(last > 0, (torch.rand(rows, generator=gen) * (last + 1).double()).long().clamp_min(1),
                          torch.ones_like(last)).to(torch.int32)
        last = Ts
        cu = torch.zeros(rows + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(Ts, 0)
        ntok = int(cu[-1])
        qkv, a, b = _inputs(gen, ntok)
        out_c = torch.full((ntok, HV, V), float("nan"), dtype=torch.float32)
        out_g = out_c.cuda()
        GPU.verify(qkv.cuda(), a.cuda(), b.cuda(), A_log.cuda(), dt_bias.cuda(), K ** -0.5, st_g, out_g,
                            idx.cuda(), cu.cuda(), ring_g, acc.cuda(), W)
        CPU.verify(qkv, a, b, A_log, dt_bias, K ** -0.5, st_c, out_c, idx, cu, ring_c, acc, W)
        real = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in range(rows) if int(idx[i]) > 0])
        assert not torch.isnan(out_g[real.cuda()]).any(), f"step {step}: unwritten output"
        n_g, p_g = unpack_cursor(ring_g.cursor.cpu())
        n_c, p_c = unpack_cursor(ring_c.cursor)
        assert torch.equal(n_g, n_c) and torch.equal(p_g, p_c), f"step {step}: cursor words differ"
        worst = max(worst, _rel(out_g[real.cuda()], out_c[real]))
    GPU.commit(ring_g, idx.cuda(), last.to(torch.int32).cuda())
    CPU.commit(ring_c, idx, last.to(torch.int32))
    assert torch.equal(ring_g.cursor.cpu(), ring_c.cursor)
    assert worst < 1e-4, f"output rel {worst}"
    assert _rel(st_g, st_c) < 1e-4


def test_cuda_refuses_cpu_numerics_before_counting():
    slots = 4
    (st_g, ring_g), _, gen = _twins(1, slots, torch.float32, torch.zeros(slots, dtype=torch.int32))
    qkv, a, b = (t.cuda() for t in _inputs(gen, 2))
    idx = torch.tensor([1, 2], dtype=torch.int32, device="cuda")
    state_before, cursor_before = st_g.clone(), ring_g.cursor.clone()
    counts = dict(STATS)
    out = torch.zeros(2, HV, V, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="round as FLA"):
        GPU.decode(qkv, a, b, torch.zeros(HV, device="cuda"), torch.zeros(HV, device="cuda"), K ** -0.5,
                       st_g, out, idx, ring_g, None, None, numerics=numerics.CPU_DECODE_NUMERICS)
    with pytest.raises(ValueError, match="round as FLA"):
        GPU.verify(qkv, a, b, torch.zeros(HV, device="cuda"), torch.zeros(HV, device="cuda"), K ** -0.5,
                            st_g, out, idx, torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda"), ring_g,
                            None, 2, numerics=numerics.CPU_SPEC_NUMERICS)
    assert dict(STATS) == counts, "a refused call must not be counted"
    assert torch.equal(st_g, state_before) and torch.equal(ring_g.cursor, cursor_before)
