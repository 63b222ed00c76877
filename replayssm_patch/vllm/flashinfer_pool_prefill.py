"""Patch point: a ring layer runs FlashInfer's GDN prefill on the state pool in place.

vLLM's layer gathers the states of all of a step's prefill sequences (up to max_num_seqs) into one
tensor, FlashInfer's prefill op (vLLM's `fi_chunk_gated_delta_rule`, the GDN prefill vLLM picks on
Hopper and Blackwell) returns their final states in a second one, in fp32, and vLLM scatters those
back: two states per prefill sequence held at the step's peak, memory a ring engine's profile
holds back from the KV cache (prefill_profile). FlashInfer's op can instead read each sequence's
initial state from the pool by row and write its final state to the same row (`state_indices`
with `output_state`). A ring layer's op calls it so: first it zeroes the rows of the sequences
that start without a state, as vLLM zeroes their gathered copies; vLLM's own gather and scatter
around the op are left the step's last sequence (prefill_groups.StepGroups.vllm_rows, the step's
groups empty), which the op gives back as it left the pool. The inputs are prepared as vLLM's
wrapper prepares them (contiguous, gate and beta in fp32, the gate exponentiated where vLLM's
wrapper does it: `exps_gate`).

Whether the kernel then gives vLLM's bits: tests/gpu/test_flashinfer_pool_prefill_gpu.py. The
releases where that passed are `versions.FLASHINFER_POOL_PREFILL_VALIDATED`; elsewhere, and
where the installed FlashInfer lacks the pool form, vLLM's call runs. The module imports only
torch and the package's versions (the GPU test runs it without vLLM).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from .. import versions

# vLLM's null block: no request's state lives in its row (padding rows point at it), so the
# zeroing may write it for the sequences that keep their state
NULL_ROW = 0


@functools.lru_cache(maxsize=None)
def flashinfer_takes_pool() -> bool:
    """The installed FlashInfer's GDN prefill reads and writes a state pool by row."""
    try:
        from flashinfer.gdn_prefill import chunk_gated_delta_rule
    except Exception:  # absent, or it fails to import on this machine: vLLM's call then fails alike
        return False
    return {"state_indices", "output_state"} <= inspect.signature(chunk_gated_delta_rule).parameters.keys()


def applies(platform: str, prefill_backend: str | None, version, align: bool) -> bool:
    """A ring layer of `platform` with vLLM's `prefill_backend` runs its prefill on the pool in
    vLLM `version` (a base version). Not in align mode (`align`, prefix caching): there vLLM calls
    FlashInfer itself, on gathered states, for every prefill step that writes checkpoints, and the
    memory profile must hold that step."""
    return (platform == "cuda" and prefill_backend == "flashinfer" and not align
            and version in versions.FLASHINFER_POOL_PREFILL_VALIDATED and flashinfer_takes_pool())


def zero_fresh_rows(states: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor) -> None:
    """Zero the pool rows of the sequences that start without a state. The others' entries name
    the null row, so no host sync picks the fresh ones out."""
    fresh = torch.where(has_initial_state, NULL_ROW, state_indices.long())
    states.index_fill_(0, fresh, 0)


def run(q, k, v, g, beta, *, states: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
        cu_seqlens: torch.Tensor, exps_gate: bool) -> torch.Tensor:
    """The step's outputs [1, tokens, heads, V] of FlashInfer's prefill over `q`..`beta` (vLLM's
    [1, tokens, heads, dim] forms), each sequence starting from its row of the pool `states`
    (`state_indices`; zeros where `has_initial_state` is false) and leaving its final state there."""
    from flashinfer.gdn_prefill import chunk_gated_delta_rule as prefill

    zero_fresh_rows(states, state_indices, has_initial_state)
    gate = g.squeeze(0).contiguous().to(torch.float32)
    out, _ = prefill(q=q.squeeze(0).contiguous(), k=k.squeeze(0).contiguous(), v=v.squeeze(0).contiguous(),
                     g=torch.exp(gate) if exps_gate else gate, beta=beta.squeeze(0).contiguous().to(torch.float32),
                     initial_state=states, output_final_state=True, output_state=states,
                     state_indices=state_indices, cu_seqlens=cu_seqlens, backend="flashinfer")
    return out.unsqueeze(0)


class PoolPrefillOp(torch.nn.Module):
    """A ring layer's prefill op: FlashInfer's on the pool where the step's ring metadata says so
    (`step_for_call` gives the step with the layer's state pool), vLLM's call otherwise."""

    def __init__(self, op: torch.nn.Module, step_for_call: Callable[[], tuple[object, torch.Tensor] | None],
                 exps_gate: bool):
        super().__init__()
        self.op = op
        self.step_for_call = step_for_call
        self.exps_gate = exps_gate

    def forward(self, *, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens=None,
                use_qk_l2norm_in_kernel=True, core_attn_out=None, **kwargs):
        step = self.step_for_call()
        if step is None:
            return self.op(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, core_attn_out=core_attn_out, **kwargs)
        step, states = step
        seqs = step.state_indices.shape[0]
        # vLLM gathered only vllm_rows() for this call: no other call of the op can serve it
        if step.groups or not output_final_state or use_qk_l2norm_in_kernel or core_attn_out is not None \
                or cu_seqlens is None or cu_seqlens.shape[0] != seqs + 1:
            raise RuntimeError("replayssm_patch: the pool prefill step does not match vLLM's call of its "
                               f"FlashInfer prefill op ({seqs} sequences in the step, cu_seqlens "
                               f"{None if cu_seqlens is None else tuple(cu_seqlens.shape)}, "
                               f"output_final_state={output_final_state}, "
                               f"use_qk_l2norm_in_kernel={use_qk_l2norm_in_kernel})")
        out = run(q, k, v, g, beta, states=states, state_indices=step.state_indices,
                  has_initial_state=step.has_initial_state, cu_seqlens=cu_seqlens, exps_gate=self.exps_gate)
        return out, states[step.state_indices[-1:]]
