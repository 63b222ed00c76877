"""Patch point: vLLM's CPU GDN core, `_cpu_gdn_attention_nonspec` / `_cpu_gdn_attention_spec_aware`
(layer, metadata, ...): the CPU build runs the core there, not through `_forward_core`. A ring
layer's core runs with the same ring bookkeeping as `_forward_core` (gdn_layer.run_with_ring);
its recurrence kernels go through the CPU wrappers."""

from __future__ import annotations

import functools

from ..ring.call import cpu_state_view, run_with_ring


def make_wrapper(native):
    def cpu_gdn_attention(layer, attn_metadata_i, *args, **kw):
        ring_metadata = getattr(layer, "ring_metadata", None)  # a ring layer (vllm.gdn_layer) has it
        md = ring_metadata() if ring_metadata is not None else None
        if md is None:
            return native(layer, attn_metadata_i, *args, **kw)
        return run_with_ring(layer, md, cpu_state_view(layer), lambda: native(layer, attn_metadata_i, *args, **kw))

    return functools.update_wrapper(cpu_gdn_attention, native)  # name, doc, __wrapped__ (signature)
