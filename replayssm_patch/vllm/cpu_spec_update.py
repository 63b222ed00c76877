"""Patch point: vLLM's CPU MTP recurrence, `fused_sigmoid_gating_delta_rule_update_spec_cpu`
(resume from slot [i, num_accepted-1], write the state after token t to slot [i, t]): inside a
ring call the ring's verify, which keeps one slot per request."""

from __future__ import annotations

import torch

from ..ops.gdn_reference import pack_qkv
from ..ring.call import call_for, ring_aware, spec_slots
from ..ring.numerics import CPU_SPEC_NUMERICS


def make_wrapper(native):
    def cpu_spec_update(p):
        src = p["initial_state_source"]
        call = call_for(src)
        if call is None:
            return native(**p)
        if not call.spec_window or not p["use_qk_l2norm_in_kernel"]:
            raise RuntimeError("GDN ring: a speculative step reached a ring layer that cannot serve it")
        cu, q = p["cu_seqlens"], p["q"]
        rows, n = cu.shape[0] - 1, q.shape[-3]
        hv, vdim = p["v"].shape[-2:]
        out = torch.empty((n, hv, vdim), dtype=q.dtype, device=q.device)
        # vLLM's CPU kernels view each head of the [slot, HV, V, K] state as [K][V] (cpu_update)
        call.ops.verify(pack_qkv(q, p["k"], p["v"]), p["a"][:n].contiguous(), p["b"][:n].contiguous(), p["A_log"],
                        p["dt_bias"], call.scale, src.transpose(-1, -2), out, spec_slots(p["spec_state_indices"], rows),
                        cu.contiguous(), call.ring, p["num_accepted_tokens"], call.spec_window,
                        numerics=CPU_SPEC_NUMERICS)
        return out

    return ring_aware(native, cpu_spec_update)
