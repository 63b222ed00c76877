"""Patch point: a ring layer runs a prefill step's chunked scan per group of chunks.

vLLM gathers the states of all of a step's prefill sequences (up to max_num_seqs) and calls its
FLA prefill op once over them; the op's temporaries grow with the step's 64-token chunks (up to
max_num_batched_tokens / 64 plus one a sequence) and its final states with the step's sequences,
and a ring engine's memory profile holds that worst step back from the KV cache
(prefill_profile). A ring layer instead runs the op per group of at most GROUP_CHUNKS chunks of at
most GROUP_SEQS sequences, and each group gathers its sequences' states from the state pool and
scatters its final states back as vLLM does for the step (in the pool's dtype, rows without
a state zeroed), so that a step holds one group's states and temporaries. vLLM's own gather and
scatter around the op are left one sequence (the step's last: `StepGroups.vllm_rows`), which the
op gives back as the groups left it. A sequence longer than a group's room is cut at a chunk
boundary; its next part runs in a group of its own, from the state the part before ended in as the
op returned it (fp32, as one call keeps it between chunks; a 16-bit pool's rounding would change
the bits). Every chunk goes through the same kernels with the same inputs either way; whether the
results are identical bit for bit and what the groups save: benchmarks/gdn_prefill_groups.py and
its results in benchmarks/results/.

The groups are drawn on the host once per step by the ring's metadata builder, beside vLLM's
chunk metadata for the same prefill (`_build_chunk_metadata`, vLLM >= 0.33, the Triton (FLA)
prefill backend), and carried to the layers in the step's metadata. Other backends and older
releases call the op as vLLM does. The module imports only torch (benchmarks use it alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# One group's size: 64 chunks of 64 tokens per head are enough blocks to keep the GPU busy; 64
# sequences bound the final states one call holds.
GROUP_CHUNKS = 64
GROUP_SEQS = 64


@dataclass(frozen=True)
class PrefillGroup:
    tokens: tuple[int, int]  # [start, end) in the step's prefill tokens
    seqs: tuple[int, int]  # [start, end) of the step's prefill sequences it has tokens of
    cu_seqlens: torch.Tensor  # the group's query start locations, from 0, on the op's device
    chunk_indices: torch.Tensor | None = None  # the op's chunk metadata for the group (None: it computes them)
    chunk_offsets: torch.Tensor | None = None


def split(cu_seqlens: Sequence[int], chunk_size: int, max_chunks: int = GROUP_CHUNKS,
          max_seqs: int = GROUP_SEQS) -> list[tuple[int, int, int, int]]:
    """Consecutive groups (first token, end token, first sequence, end sequence) of the step whose
    query start locations are `cu_seqlens`, each of at most `max_chunks` chunks of at most
    `max_seqs` sequences. A sequence is cut where a group's chunks run out (a chunk boundary of
    the sequence); the groups that go on with it hold nothing else, so that its state passes
    between them as the op gives it (`run`)."""
    groups, t0, s0, chunks = [], 0, 0, 0
    for s in range(len(cu_seqlens) - 1):
        t, end = cu_seqlens[s], cu_seqlens[s + 1]
        while t < end:
            if chunks == max_chunks or s - s0 == max_seqs:  # full: the group ends before t
                groups.append((t0, t, s0, s + (t > cu_seqlens[s])))  # with the part of s it has
                t0, s0, chunks = t, s, 0
            take = min(end - t, (max_chunks - chunks) * chunk_size)
            chunks += -(-take // chunk_size)
            t += take
        if t0 > cu_seqlens[s]:  # a group that went on with s ends with it
            groups.append((t0, end, s, s + 1))
            t0, s0, chunks = end, s + 1, 0
    if t0 < cu_seqlens[-1] or not groups:
        groups.append((t0, cu_seqlens[-1], s0, len(cu_seqlens) - 1))
    return groups


def plan(cu_seqlens_cpu: torch.Tensor, chunk_size: int, to_device: Callable[[torch.Tensor], tuple],
         max_chunks: int = GROUP_CHUNKS, max_seqs: int = GROUP_SEQS) -> tuple[PrefillGroup, ...] | None:
    """The step's groups (`split`), or None where one call holds no more than a group.
    `to_device(cu)` gives a group's host query start locations (from 0) as (cu_seqlens,
    chunk_indices, chunk_offsets) for the op."""
    cu = cu_seqlens_cpu.tolist()
    ranges = split(cu, chunk_size, max_chunks, max_seqs)
    if len(ranges) < 2:
        return None
    groups = []
    for t0, t1, s0, s1 in ranges:
        bounds = [t0, *(x for x in cu[s0 + 1:s1] if t0 < x < t1), t1]
        local = torch.tensor(bounds, dtype=cu_seqlens_cpu.dtype) - t0
        groups.append(PrefillGroup((t0, t1), (s0, s1), *to_device(local)))
    return tuple(groups)


def fla_chunk_size() -> int:
    """The tokens of one chunk of vLLM's FLA prefill op (vLLM >= 0.33)."""
    from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE

    return FLA_CHUNK_SIZE


@dataclass(frozen=True)
class StepGroups:
    """A step's prefill as the ring layers run it: its groups and where its sequences' states are."""
    groups: tuple[PrefillGroup, ...]  # () where the layer's op runs the whole step on the pool (flashinfer_pool_prefill)
    state_indices: torch.Tensor  # the state pool's row of each prefill sequence (vLLM's prefill_state_indices)
    has_initial_state: torch.Tensor  # per prefill sequence: whether its row holds a state (else it starts at 0)

    def vllm_rows(self) -> dict[str, torch.Tensor]:
        """The prefill rows vLLM's layer gathers before the op and scatters after it: the last
        sequence's only, which the grouped op gives back as it left it (the groups do the rest)."""
        return {"prefill_state_indices": self.state_indices[-1:],
                "prefill_has_initial_state": self.has_initial_state[-1:]}


def run(op, groups: Sequence[PrefillGroup], *, q, k, v, g, beta, states: torch.Tensor,
        state_indices: torch.Tensor, has_initial_state: torch.Tensor, **kwargs) -> torch.Tensor:
    """`op` (vLLM's chunk_gated_delta_rule interface) per group; returns the step's outputs. Each
    group starts from its sequences' rows of the pool `states` (`state_indices`; zeros where
    `has_initial_state` is false, as vLLM gathers them) and writes its final states there in the
    pool's dtype, as vLLM scatters them. A cut sequence's next part starts from the state its part
    before ended in, as the op gave it (fp32: one call never rounds it to the pool's dtype between
    chunks)."""
    out, carry = None, None
    for grp, nxt in zip(groups, [*groups[1:], None]):
        (t0, t1), (s0, s1) = grp.tokens, grp.seqs
        rows = state_indices[s0:s1]
        if carry is None:
            init = states[rows]  # (masked_fill_: zeros without the host sync of vLLM's boolean-mask assignment)
            init.masked_fill_(~has_initial_state[s0:s1].view(-1, *(1,) * (init.dim() - 1)), 0)
        else:  # (split: a cut sequence's group is its own)
            init = carry[None]
        o, final = op(q=q[:, t0:t1], k=k[:, t0:t1], v=v[:, t0:t1], g=g[:, t0:t1], beta=beta[:, t0:t1],
                      initial_state=init, output_final_state=True,
                      **(kwargs | {"cu_seqlens": grp.cu_seqlens, "chunk_indices": grp.chunk_indices,
                                   "chunk_offsets": grp.chunk_offsets}))
        if out is None:
            out = o.new_empty((o.shape[0], q.shape[1], *o.shape[2:]))
        out[:, t0:t1] = o
        states[rows] = final.to(states.dtype)
        carry = final[-1].clone() if nxt is not None and nxt.seqs[0] == s1 - 1 else None
        del o, final, init  # before the next group's temporaries
    return out


class GroupedPrefillOp(torch.nn.Module):
    """A ring layer's prefill op: vLLM's, run per group where the step's ring metadata carries
    groups (`step_for_call` gives them with the layer's state pool), as vLLM calls it otherwise."""

    def __init__(self, op: torch.nn.Module,
                 step_for_call: Callable[[], tuple[StepGroups, torch.Tensor] | None]):
        super().__init__()
        self.op = op
        self.step_for_call = step_for_call

    def forward(self, *, q, k, v, g, beta, initial_state, output_final_state, **kwargs):
        step = self.step_for_call()
        if step is None:
            return self.op(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                           output_final_state=output_final_state, **kwargs)
        groups, states = step
        # vLLM gathered only vllm_rows() for this call: no other call of the op can serve it
        if not output_final_state or kwargs.get("core_attn_out") is not None or \
                groups.groups[-1].tokens[1] != q.shape[1] or groups.groups[-1].seqs[1] != groups.state_indices.shape[0]:
            raise RuntimeError("replayssm_patch: the GDN prefill groups of this step do not match vLLM's "
                               f"call of its prefill op ({q.shape[1]} tokens, {groups.state_indices.shape[0]} "
                               f"sequences, output_final_state={output_final_state})")
        out = run(self.op, groups.groups, q=q, k=k, v=v, g=g, beta=beta, states=states,
                  state_indices=groups.state_indices, has_initial_state=groups.has_initial_state, **kwargs)
        return out, states[groups.state_indices[-1:]]
