"""Patch point: vLLM's memory profile sees one GDN prefill step of the engine's token budget.

vLLM sizes the KV cache from a profile run whose dummy forward has no attention metadata, so
its GDN layers skip their core there and only warm the prefill kernels on 64 tokens
(`_warmup_prefill_kernels`, in every release the package supports; vllm-project/vllm#54775). A
real prefill step's temporaries (the causal conv's output, q/k/v/g/beta, every prefill sequence's
gathered and final state, the chunked scan's own) are then memory the engine holds beyond what it
accounted; how much: benchmarks/results/gdn_prefill_memory_h100_2026-12-07/. A ring layer
therefore runs, in its profile forward on CUDA, after vLLM's warmup, the worst step vLLM's
scheduler may send it (the profile's tokens over as many sequences as `max_num_seqs` allows)
through the layer's own prefill op, as the layer runs it (per group of chunks where it does:
prefill_groups; on the state pool where it does: flashinfer_pool_prefill), so that the profile's
peak includes it and the KV cache is sized without it.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from . import prefill_groups


def seq_lens(tokens: int, seqs: int) -> list[int]:
    """`tokens` spread over `seqs` sequences as evenly as integers allow (many short sequences
    are the costly case: each holds a gathered state, a final state and a chunk of the scan)."""
    base, extra = divmod(tokens, seqs)
    return [base + (i < extra) for i in range(seqs)]


def group_filling_lens(tokens: int, seqs: int, chunk_size: int) -> list[int]:
    """`tokens` over `seqs` sequences so that the first prefill group is as large as a group may
    be in its chunks, its tokens and its sequences (the costly group): the other sequences share
    what is left evenly; with none left, the group's last sequence takes it."""
    first = min(prefill_groups.GROUP_SEQS, seqs)
    rest = seqs - first
    each = max(1, prefill_groups.GROUP_CHUNKS // first) * chunk_size
    first_tokens = min(first * each, tokens - rest)
    lens = seq_lens(first_tokens, first) + (seq_lens(tokens - first_tokens, rest) if rest else [])
    lens[first - 1] += tokens - sum(lens)
    return lens


def prefill_step(chunk, qkv: torch.Tensor, heads: tuple[int, int], state_shape: tuple[int, ...],
                 state_dtype: torch.dtype, seqs: int, chunk_size: int | None = None,
                 spec_decode: bool = False, on_pool: bool = False) -> None:
    """The allocations of one prefill step of vLLM's GDN core over `qkv`'s tokens (the in-projection's
    q/k/v part, [tokens, (2 * key_heads + value_heads) * head_dim]) spread over `seqs` sequences,
    with the scan run through `chunk` (vLLM's `chunk_gated_delta_rule` interface): in one call, as
    vLLM makes it, or, given the op's `chunk_size`, per group as a ring layer's prefill op makes it
    (prefill_groups), or, `on_pool`, with `chunk` flashinfer_pool_prefill.run's interface, on the
    state pool as a ring layer's FlashInfer op makes it. `spec_decode`: the engine speculates, so a
    prefill step beside verify rows first copies its prefill tokens out of the step's (vLLM's
    `index_select` of the non-spec tokens, kept to the end of the core as the conv's input).
    What is computed does not matter here, only what is held while it runs; `heads` = (key heads,
    value heads) of this rank, `state_shape` = one sequence's SSM state [value heads, V, K]."""
    hk, hv = heads
    tokens, dev = qkv.shape[0], qkv.device
    dv, dk = state_shape[1], state_shape[2]
    conv_input = qkv.index_select(0, torch.arange(tokens, device=dev)) if spec_decode else qkv
    conv = torch.empty_like(conv_input).copy_(conv_input)  # the causal conv writes a new tensor of this size
    q, k, v = conv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = F.normalize(q.reshape(1, tokens, hk, dk), dim=-1)  # the post-conv prep's outputs
    k = F.normalize(k.reshape(1, tokens, hk, dk), dim=-1)
    v = v.contiguous().view(1, tokens, hv, dv)
    g = torch.zeros(1, tokens, hv, device=dev, dtype=torch.float32)  # log decay and beta, fp32
    beta = torch.full((1, tokens, hv), 0.5, device=dev, dtype=torch.float32)
    lens = seq_lens(tokens, seqs) if chunk_size is None else group_filling_lens(tokens, seqs, chunk_size)
    cu_host = torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, use_qk_l2norm_in_kernel=False)
    if on_pool:  # the pool is the KV cache's: one row here, every sequence's (what it holds is never read)
        pool = torch.zeros(1, *state_shape, device=dev, dtype=state_dtype)
        out = chunk(q, k, v, g, beta, states=pool, state_indices=torch.zeros(seqs, device=dev, dtype=torch.int32),
                    has_initial_state=torch.ones(seqs, device=dev, dtype=torch.bool), cu_seqlens=cu_host.to(dev))
        del out
        return
    groups = None if chunk_size is None else prefill_groups.plan(cu_host, chunk_size, lambda cu: (cu.to(dev), None, None))
    if groups is not None:  # each group gathers its sequences' states from the pool (the KV cache's: one row here)
        pool = torch.zeros(1, *state_shape, device=dev, dtype=state_dtype)
        rows = torch.zeros(seqs, device=dev, dtype=torch.int64)
        out = prefill_groups.run(chunk, groups, **args, states=pool, state_indices=rows,
                                 has_initial_state=torch.ones(seqs, device=dev, dtype=torch.bool))
        del out
        return
    initial = torch.zeros(seqs, *state_shape, device=dev, dtype=state_dtype)  # the states vLLM gathers
    out, final = chunk(**args, initial_state=initial, output_final_state=True, cu_seqlens=cu_host.to(dev))
    scattered = final.to(state_dtype)  # the scatter back into the pool converts first
    del out, scattered


def profile_seqs(tokens: int, max_num_seqs: int) -> int:
    """How many sequences the profiled step spreads `tokens` over: all vLLM may schedule."""
    return max(1, min(tokens, max_num_seqs))
