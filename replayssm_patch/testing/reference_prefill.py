"""Prefill ops for CPU tests, from the package's float64 reference recurrence (ops.gdn_reference):
`ReferencePrefill` with vLLM's `chunk_gated_delta_rule` interface, as the FLA op returns its
results (outputs in v's dtype, final states fp32), and `ReferenceFlashInferPrefill` with
FlashInfer's `gdn_prefill.chunk_gated_delta_rule` interface as its documentation states it
(sequence-ordered states, or a pool read and written by row). Both record what they are given."""

from __future__ import annotations

import torch

from ..ops import gdn_reference


def per_sequence(q, k, v, log_g, beta, cu_seqlens, initial_states):
    """Each sequence of `cu_seqlens` through the float64 reference recurrence from its entry of
    `initial_states` ([HV, V, K] each), inputs [tokens, heads, dim] ([tokens, HV] for the log decay
    and beta), the key heads repeated per value head; returns (the outputs [tokens, HV, V], the
    final states)."""
    group = v.shape[1] // q.shape[1]
    qe, ke = (x.double().repeat_interleave(group, dim=1) for x in (q, k))  # key heads per value head
    outs, finals = [], []
    for n, h0 in enumerate(initial_states):
        t0, t1 = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        o, h = gdn_reference.recurrent_sequence_reference(
            qe[t0:t1], ke[t0:t1], v[t0:t1].double(), log_g[t0:t1].double(), beta[t0:t1].double(), h0.double())
        outs.append(o)
        finals.append(h)
    return torch.cat(outs), finals


class ReferencePrefill:
    def __init__(self):
        self.calls = []

    def __call__(self, *, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                 use_qk_l2norm_in_kernel, chunk_indices=None, chunk_offsets=None):
        self.calls.append(dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state.clone(),
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens.clone(),
                               l2norm=use_qk_l2norm_in_kernel, chunk_indices=chunk_indices,
                               chunk_offsets=chunk_offsets))
        outs, finals = per_sequence(q[0], k[0], v[0], g[0], beta[0], cu_seqlens, initial_state.unbind(0))
        return outs[None].to(v.dtype), torch.stack(finals).float()


class ReferenceFlashInferPrefill:
    """FlashInfer's GDN prefill as documented: q/k/v [tokens, heads, dim], the gate already
    exponentiated, fp32 gate and beta; without `state_indices` the initial states are in sequence
    order and the final states come back in a new fp32 tensor, with it `initial_state` and
    `output_state` are pools whose row `state_indices[i]` sequence i reads and writes."""

    def __init__(self):
        self.calls = []

    def __call__(self, *, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, output_state=None,
                 state_indices=None, backend="auto", **unused):
        assert g.dtype == beta.dtype == torch.float32 and q.dim() == 3 and output_final_state
        self.calls.append(dict(q=q, g=g, beta=beta, initial_state=initial_state, output_state=output_state,
                               state_indices=state_indices, cu_seqlens=cu_seqlens.clone(), backend=backend,
                               unused=unused))
        rows = range(cu_seqlens.shape[0] - 1) if state_indices is None else state_indices.tolist()
        outs, finals = per_sequence(q, k, v, torch.log(g.double()), beta, cu_seqlens, [initial_state[r] for r in rows])
        out = outs.to(v.dtype)
        if state_indices is None:
            return out, torch.stack(finals).float()
        for row, h in zip(rows, finals):  # every sequence read its row before any is written
            output_state[row] = h.to(output_state.dtype)
        return out, output_state
