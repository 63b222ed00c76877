"""Patch point: vLLM's decode recurrence for pure decode batches on CUDA,
`qwen_gdn_linear_attn.fused_recurrent_gated_delta_rule_packed_decode`: inside a ring call its
rows decode through the ring (or, on a step the plan leaves native, are flushed first)."""

from __future__ import annotations

from ..ring.call import call_for, passthrough, ring_aware


def make_wrapper(native):
    def packed_decode(p):
        state, idx = p["initial_state"], p["ssm_state_indices"]
        call = call_for(state)
        if call is None or not p["use_qk_l2norm_in_kernel"]:
            return passthrough(native, call, state, idx, p)
        x, out = p["mixed_qkv"], p["out"]
        n = x.shape[0]
        if call.native_decode:
            return passthrough(native, call, state, idx, p, rows=n)
        call.ops.decode(x, p["a"], p["b"], p["A_log"], p["dt_bias"], p["scale"], state, out.view(n, -1, out.shape[-1]),
                        idx[:n], call.ring, call.force_flush[:n], call.start_empty[:n])
        return out, state

    return ring_aware(native, packed_decode)
