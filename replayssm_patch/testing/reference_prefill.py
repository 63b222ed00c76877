"""A prefill op with vLLM's `chunk_gated_delta_rule` interface for CPU tests: it records what it
is given and returns each sequence's outputs and final state from the package's float64
reference recurrence (ops.gdn_reference), as the FLA op returns them (outputs in v's dtype, final
states fp32)."""

from __future__ import annotations

import torch

from ..ops import gdn_reference


class ReferencePrefill:
    def __init__(self):
        self.calls = []

    def __call__(self, *, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                 use_qk_l2norm_in_kernel, chunk_indices=None, chunk_offsets=None):
        self.calls.append(dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state.clone(),
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens.clone(),
                               l2norm=use_qk_l2norm_in_kernel, chunk_indices=chunk_indices,
                               chunk_offsets=chunk_offsets))
        group = v.shape[2] // q.shape[2]
        qe, ke = (x[0].double().repeat_interleave(group, dim=1) for x in (q, k))  # key heads per value head
        outs, finals = [], []
        for n in range(initial_state.shape[0]):
            t0, t1 = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
            o, h = gdn_reference.recurrent_sequence_reference(
                qe[t0:t1], ke[t0:t1], v[0, t0:t1].double(), g[0, t0:t1].double(), beta[0, t0:t1].double(),
                initial_state[n].double())
            outs.append(o)
            finals.append(h)
        return torch.cat(outs)[None].to(v.dtype), torch.stack(finals).float()
