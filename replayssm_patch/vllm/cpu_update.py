"""Patch point: vLLM's CPU decode recurrence, `fused_sigmoid_gating_delta_rule_update_cpu`:
inside a ring call the ring's step, taken by this very kernel from each row's replayed state
(ring.cpu)."""

from __future__ import annotations

from ..ring import shadow
from ..ring.call import call_for, one_token_rows, passthrough, ring_aware


def make_wrapper(native):
    def cpu_update(p):
        src, idx, q = p["initial_state_source"], p["initial_state_indices"], p["q"]
        call = call_for(src)
        if call is None:
            return native(**p)
        # vLLM's CPU kernels view each head of the [slot, HV, V, K] state as [K][V]; the same
        # bytes read as [V, K] are the transpose of that view.
        state = src.transpose(-1, -2)
        n = q.shape[1]
        if not one_token_rows(p["cu_seqlens"], n) or not p["use_qk_l2norm_in_kernel"]:
            return passthrough(native, call, state, idx, p)
        if call.native_decode:
            out = passthrough(native, call, state, idx, p, rows=n)
            if call.ring.shadow is not None:  # native advanced the canonical states: the shadow follows
                shadow.sync_slots(call.ring, src, idx[:n])
            return out
        # The step itself is this kernel's, taken from the replayed state: exact on empty rings.
        out = call.ops.decode_with_kernel(native, p, call.ring, call.force_flush, call.start_empty)
        if call.ring.shadow is not None:
            shadow.check_decode(native, p, call.ring, out, call.start_empty, call.ops.stats)
        return out

    return ring_aware(native, cpu_update)
