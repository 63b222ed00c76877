"""A ring layer's prefill groups against one call of vLLM's FLA prefill op, on a CUDA GPU
(replayssm_patch/vllm/prefill_groups.py, issue 46).

Fresh random steps (uneven lengths, single-token sequences, sequences many chunks long), grouped
with the package's default bounds and with small ones that cut most sequences; the groups get
their chunk metadata from vLLM's own host functions, as the ring's builder gives it them. Each
group gathers its states from a pool and scatters its final states back; the outputs and the
pool must be the same bits as vLLM's gather, one call and scatter give, fp32 and bf16 states (a
cut sequence's state passes between its parts in fp32). The memory saved:
benchmarks/gdn_prefill_groups.py.

vLLM >= 0.33 on CUDA (`bash benchmarks/gpu_run.sh ktest` with KTESTS naming this file); skipped
elsewhere.
"""

from __future__ import annotations

from itertools import accumulate

import pytest

from replayssm_patch.testing import gpu_engines

gpu_engines.require_cuda("0.33", "vLLM's FLA chunk metadata on the host")
pytestmark = pytest.mark.gpu

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from replayssm_patch.vllm import prefill_groups  # noqa: E402

HK, HV, D = 4, 8, 128


def fla():
    from vllm.third_party.flash_linear_attention.ops import chunk_gated_delta_rule
    from vllm.third_party.flash_linear_attention.ops.index import prepare_chunk_indices, prepare_chunk_offsets

    return chunk_gated_delta_rule, prepare_chunk_indices, prepare_chunk_offsets


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bounds", [(prefill_groups.GROUP_CHUNKS, prefill_groups.GROUP_SEQS), (3, 5)])
@pytest.mark.parametrize("seed", range(3))
def test_groups_give_the_bits_of_one_call(seed, bounds, state_dtype):
    op, chunk_indices, chunk_offsets = fla()
    chunk = prefill_groups.fla_chunk_size()
    gen = torch.Generator().manual_seed(460 + seed)
    seqs = [70, 9, 130][seed]
    lens = [int(x) for x in torch.randint(1, [200, 1500, 90][seed], (seqs,), generator=gen)]
    lens[0], lens[-1] = 1, 5000  # a single token; one sequence that needs several groups
    cu_host = torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
    tokens, dev = int(cu_host[-1]), "cuda"
    q = F.normalize(torch.randn(1, tokens, HK, D, generator=gen), dim=-1).to(dev, torch.bfloat16)
    k = F.normalize(torch.randn(1, tokens, HK, D, generator=gen), dim=-1).to(dev, torch.bfloat16)
    v = torch.randn(1, tokens, HV, D, generator=gen).to(dev, torch.bfloat16)
    g = (-F.softplus(torch.randn(1, tokens, HV, generator=gen))).to(dev)
    beta = torch.sigmoid(torch.randn(1, tokens, HV, generator=gen)).to(dev)
    # the state pool: the step's rows among others, some sequences without a state yet
    pool = (0.1 * torch.randn(seqs + 9, HV, D, D, generator=gen)).to(dev, state_dtype)
    rows = torch.randperm(seqs + 9, generator=gen)[:seqs].to(dev)
    has = (torch.rand(seqs, generator=gen) < 0.7).to(dev)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, use_qk_l2norm_in_kernel=False)

    pool_whole = pool.clone()  # as vLLM runs the step: gather, one call, scatter
    initial = pool_whole[rows]
    initial[~has, ...] = 0
    o_whole, f_whole = op(**args, initial_state=initial, output_final_state=True,
                          cu_seqlens=cu_host.to(dev), chunk_indices=chunk_indices(cu_host, chunk).to(dev),
                          chunk_offsets=chunk_offsets(cu_host, chunk).to(dev))
    pool_whole[rows] = f_whole.to(state_dtype)

    def to_device(cu):  # as the ring's builder: vLLM's host functions per group
        return cu.to(dev), chunk_indices(cu, chunk).to(dev), chunk_offsets(cu, chunk).to(dev)

    groups = prefill_groups.plan(cu_host, chunk, to_device, *bounds)
    assert groups is not None and len(groups) > 1
    assert sum(grp.seqs[1] - grp.seqs[0] for grp in groups) > seqs  # some sequence was cut
    pool_groups = pool.clone()
    o_groups = prefill_groups.run(op, groups, **args, states=pool_groups, state_indices=rows, has_initial_state=has)
    assert torch.equal(o_groups, o_whole)
    assert torch.equal(pool_groups, pool_whole)  # every row: the step's as vLLM scatters them, the others kept
