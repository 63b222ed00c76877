"""Patch point: on CUDA, a step whose rows are all MTP verify rows (every request decoding) makes
vLLM's two calls itself, conv update then the ring's verify, without vLLM's unfused Python
around them (the q/k/v split and `cat` the wrapper would undo with another `cat`, the argument
binding, the final copy), which cost the host more than the GPU work it wrapped at large batches
(benchmarks/results/verify_step_2026-12-04/). The conv call is vLLM's own `_forward_core` call for
such a step, argument for argument; its probe checks that vLLM still makes it so."""

from __future__ import annotations

from ..ring.call import flashinfer_serves


def applies(md) -> bool:
    """A step of verify rows alone, with the accepted counts its verify commits by."""
    return (md.spec_sequence_masks is not None and md.num_prefills == 0 and md.num_decodes == 0
            and md.num_accepted_tokens is not None)


def verify_step(layer, md, mixed_qkv, b, a, core_attn_out, gdn) -> None:
    """vLLM's conv update, then the ring's verify on its output, written into `core_attn_out`.
    `gdn`: vLLM's GDN layer module, whose conv op and conv-state layout its `_forward_core` uses
    (the same call in vLLM 0.32, 0.33 and 0.34).

    Every row below num_actual_tokens is written (vLLM 0.34 allocates `core_attn_out` with
    torch.empty, 0.32 / 0.33 with zeros). Where the host metadata shows a batch padded for a CUDA
    graph (num_actual_tokens counts padding tokens no verify row owns), the verify takes the rows'
    tokens alone (as FlashInfer's kernel needs: rows x window tokens) and the padding rows are
    zeroed. A FULL graph replays its capture's batch, which has no such tokens: there the padding
    stays unwritten, as vLLM's own kernel leaves it (its output buffer is uninitialised too)."""
    n, rows, tokens = md.num_actual_tokens, md.num_spec_decodes, md.num_spec_decode_tokens
    idx = md.spec_state_indices_tensor
    conv_state = layer.kv_cache[0] if gdn.is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)
    weight = layer.conv1d.weight
    x = gdn.causal_conv1d_update(
        mixed_qkv[:n], conv_state, weight.view(weight.size(0), weight.size(2)), layer.conv1d.bias,
        layer.activation, conv_state_indices=idx[:, 0][:rows], num_accepted_tokens=md.num_accepted_tokens,
        query_start_loc=md.spec_query_start_loc, max_query_len=idx.size(-1), validate_data=False)
    if n > tokens:
        core_attn_out[tokens:n].zero_()
    plan = layer.ring_plan
    layer.ring_ops.verify(x[:tokens], a[:tokens], b[:tokens], layer.A_log, layer.dt_bias, layer.head_k_dim ** -0.5,
                          layer.kv_cache[1], core_attn_out[:tokens], idx[:rows, 0], md.spec_query_start_loc[:rows + 1],
                          layer.replay_ring, md.num_accepted_tokens, plan.spec_window,
                          flashinfer=flashinfer_serves(plan, md))
