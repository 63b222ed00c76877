"""Patch point: vLLM's recurrence for the decode rows of mixed batches and, with
`num_accepted_tokens`, the MTP verify on CUDA, `qwen_gdn_linear_attn.fused_sigmoid_gating_delta_rule_update`:
inside a ring call decode rows go to the ring's decode and verify calls to the ring's verify;
anything else passes through after its rows' rings are flushed."""

from __future__ import annotations

import torch

from ..ops.gdn_reference import pack_qkv
from ..ring.call import call_for, one_token_rows, passthrough, ring_aware, spec_slots


def make_wrapper(native):
    def sigmoid_update(p):
        state, idx, q = p["initial_state"], p["ssm_state_indices"], p["q"]
        call = call_for(state)
        if call is None:
            return native(**p)
        n = q.shape[1]
        acc = p.get("num_accepted_tokens")
        qkv = lambda: pack_qkv(q, p["k"], p["v"])  # noqa: E731 (the ring kernels take q/k/v packed)
        hv, vdim = p["v"].shape[-2:]
        if (acc is not None and call.spec_window and p["cu_seqlens"] is not None
                and p["use_qk_l2norm_in_kernel"] and p["inplace_final_state"]):
            cu = p["cu_seqlens"]
            out = torch.empty((1, n, hv, vdim), dtype=q.dtype, device=q.device)
            call.ops.verify(qkv(), p["a"][:n].contiguous(), p["b"][:n].contiguous(), p["A_log"], p["dt_bias"],
                            call.scale, state, out.view(n, hv, vdim), spec_slots(idx, cu.shape[0] - 1),
                            cu.contiguous(), call.ring, acc, call.spec_window, flashinfer=call.flashinfer_verify)
            return out, state
        if (acc is not None or not one_token_rows(p["cu_seqlens"], n)
                or not p["use_qk_l2norm_in_kernel"] or not p["inplace_final_state"]):
            return passthrough(native, call, state, idx, p)
        if call.native_decode:
            return passthrough(native, call, state, idx, p, rows=n)
        out = torch.empty((1, n, hv, vdim), dtype=q.dtype, device=q.device)
        call.ops.decode(qkv(), p["a"][:n], p["b"][:n], p["A_log"], p["dt_bias"], call.scale, state,
                        out.view(n, hv, vdim), idx[:n], call.ring, call.force_flush[:n], call.start_empty[:n])
        return out, state

    return ring_aware(native, sigmoid_update)
