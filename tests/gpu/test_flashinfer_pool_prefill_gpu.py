"""A ring layer's FlashInfer GDN prefill on the state pool in place against vLLM's form of the same
call, on a CUDA GPU with FlashInfer (replayssm_patch/vllm/flashinfer_pool_prefill.py, issue 46).

vLLM's form: the step's states gathered from the pool (zeros for sequences without one) in fp32,
FlashInfer's prefill in sequence order, its fp32 final states scattered back in the pool's dtype.
The pool form: `flashinfer_pool_prefill.run`, FlashInfer reading and writing the pool by row.
Fresh random steps: many short sequences, a few long ones, one sequence alone (where FlashInfer's
heuristic may pick its context-parallel kernel), fp32 and bf16 pools whose other rows hold NaN.
The outputs and every pool row but the null row must be the same bits. How vLLM prepares the
op's inputs is checked on CPU against vLLM's own wrapper (tests/test_flashinfer_pool_prefill.py).

FlashInfer with the pool form (`bash benchmarks/gpu_run.sh fiinstall`, then `ktest` with KTESTS
naming this file; vLLM itself is not needed); skipped elsewhere.
"""

from __future__ import annotations

from itertools import accumulate

import pytest

from replayssm_patch.testing import gpu_engines

gpu_engines.require_cuda()
pytestmark = pytest.mark.gpu

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from replayssm_patch.vllm import flashinfer_pool_prefill  # noqa: E402

if not flashinfer_pool_prefill.flashinfer_takes_pool():
    pytest.skip("needs FlashInfer's GDN prefill with state_indices", allow_module_level=True)

HK, HV, D = 4, 8, 128  # FlashInfer's prefill takes head dim 128 only


def step(seed: int, state_dtype: torch.dtype, paged: bool):
    gen = torch.Generator().manual_seed(470 + seed)
    lens = [[int(x) for x in torch.randint(1, 120, (150,), generator=gen)],
            [1, 3000, 70, 5, 1200, 64, 65],
            [4000]][seed]
    seqs = len(lens)
    cu = torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
    tokens, dev = int(cu[-1]), "cuda"
    q = F.normalize(torch.randn(1, tokens, HK, D, generator=gen), dim=-1).to(dev, torch.bfloat16)
    k = F.normalize(torch.randn(1, tokens, HK, D, generator=gen), dim=-1).to(dev, torch.bfloat16)
    v = torch.randn(1, tokens, HV, D, generator=gen).to(dev, torch.bfloat16)
    g = (-F.softplus(torch.randn(1, tokens, HV, generator=gen))).to(dev)  # the log decay, as vLLM 0.33's layer gives it
    beta = torch.sigmoid(torch.randn(1, tokens, HV, generator=gen)).to(dev)
    # rows outside the step hold NaN; `paged`: each row inside a larger page, as a ring layer's pool is
    size = HV * D * D
    pages = torch.full((seqs + 9, size + (1024 if paged else 0)), float("nan"), dtype=state_dtype)

    def pool_of(pages):
        return pages[:, 512:512 + size].unflatten(1, (HV, D, D)) if paged else pages.view(-1, HV, D, D)

    rows = 1 + torch.randperm(seqs + 8, generator=gen)[:seqs]  # unique, never the null row
    pool_of(pages)[rows] = (0.1 * torch.randn(seqs, HV, D, D, generator=gen)).to(state_dtype)
    has = torch.rand(seqs, generator=gen) < 0.7
    has[0] = not has[-1]  # both kinds in every step with two sequences or more
    pool = pool_of(pages.to(dev))
    return (q, k, v, g, beta), pool, rows.to(dev, torch.int32), has.to(dev), cu.to(dev)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_the_pool_form_gives_the_bits_of_vllms_form(seed, state_dtype, paged):
    from flashinfer.gdn_prefill import chunk_gated_delta_rule

    (q, k, v, g, beta), pool, rows, has, cu = step(seed, state_dtype, paged)
    assert pool.is_contiguous() != paged
    vllm_pool = pool.clone()  # vLLM's form: gather in fp32, sequence order, scatter
    initial = vllm_pool[rows].to(torch.float32)
    initial[~has] = 0
    out_vllm, final = chunk_gated_delta_rule(
        q=q[0].contiguous(), k=k[0].contiguous(), v=v[0].contiguous(), g=torch.exp(g[0].contiguous().float()),
        beta=beta[0].contiguous().float(), initial_state=initial, output_final_state=True,
        cu_seqlens=cu.to(torch.int64), backend="flashinfer")
    vllm_pool[rows] = final.to(state_dtype)

    out = flashinfer_pool_prefill.run(q, k, v, g, beta, states=pool, state_indices=rows, has_initial_state=has,
                                      cu_seqlens=cu, exps_gate=True)
    torch.cuda.synchronize()
    assert torch.equal(out[0], out_vllm)
    assert torch.equal(pool[rows], vllm_pool[rows])
    others = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    others[rows.long()] = False
    others[flashinfer_pool_prefill.NULL_ROW] = False
    assert pool[others].isnan().all()  # nothing outside the step was written
