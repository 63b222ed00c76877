"""Patch points: vLLM's align-mode state moves under speculative decoding,
`MambaSpecDecodeGPUContext` (vllm/v1/worker/mamba_utils.py), for the ring layers' SSM state.

* `initialize_from_forward_context`: also captures the ring layers, the block tables and vLLM's
  copy lists (`ring.align.Moves`, kept on the context);
* `run_fused_precopy` (V1 and V2, before a step): the ring's migration, then vLLM's copies;
* `run_fused_postprocess` (V1) / `run_fused_postprocess_align` (V2), after sampling: the ring's
  commit + boundary publish FIRST, while `num_accepted_tokens` still holds this step's counts
  (vLLM's kernel sets it to 1 where the running block keeps the boundary), then vLLM's copies.

On CPU vLLM's fused copies are Triton kernels that cannot run: the wrappers make the same copies
in torch (`ring.align.cpu_copy`) instead of calling them. A context without ring layers (the plan
kept MTP native) is left to vLLM untouched.
"""

from __future__ import annotations

import functools

import torch

from ..ring import align
from ..state import STATE

_MOVES = "_replayssm_moves"  # the context's attribute holding its ring.align.Moves (None: no ring layer)


def _ring_layer(layer) -> bool:
    """A GDN layer whose plan serves MTP on the ring (its cache is read at each move: vLLM may
    rebind it after this context is initialised)."""
    plan = getattr(layer, "ring_plan", None)
    return plan is not None and plan.serves and bool(plan.spec_tokens)


def make_initialize_wrapper(native):
    def initialize_from_forward_context(self, kv_cache_config, forward_context, mamba_state_copy_funcs,
                                        block_tables, aligned_index_block_tables=None):
        was = self.is_initialized
        native(self, kv_cache_config, forward_context, mamba_state_copy_funcs, block_tables,
               aligned_index_block_tables)
        if not was:
            setattr(self, _MOVES, _capture(self, kv_cache_config, forward_context, mamba_state_copy_funcs,
                                           block_tables))

    return functools.update_wrapper(initialize_from_forward_context, native)


def _capture(ctx, kv_cache_config, forward_context, copy_funcs, block_tables):
    """The engine's ring.align.Moves, in vLLM's own order of groups, layers and states."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, is_conv_state_dim_first

    layers, ring_groups, copies = [], [], []
    for g, group_id in enumerate(ctx.mamba_group_ids):
        group = kv_cache_config.kv_cache_groups[group_id]
        for name in group.layer_names:
            layer = forward_context[name]
            if _ring_layer(layer):
                layers.append(layer)
                ring_groups.append(g)
            spec = getattr(group.kv_cache_spec, "kv_cache_specs", {}).get(name, group.kv_cache_spec)
            for state, fn in zip(layer.kv_cache, copy_funcs[spec.mamba_type]):
                copies.append(align.StateCopy(state, g, fn is get_conv_copy_spec, is_conv_state_dim_first()))
    if not layers:
        return None
    spec_tokens = layers[0].ring_plan.spec_tokens
    if ctx.block_size < spec_tokens + 1:  # the plan refuses it where it knows the block size
        raise RuntimeError(f"GDN ring: mamba block size {ctx.block_size} below the verify window "
                           f"{spec_tokens + 1}: a window could cross two block boundaries")
    return align.Moves(ctx.block_size, [align.full_table(t) for t in block_tables], layers, ring_groups, copies,
                       STATE.stats, use_kernel=block_tables[0].is_cuda)


def make_precopy_wrapper(native):
    def run_fused_precopy(self, num_reqs, state_idx_gpu, src_col_gpu, token_bias_gpu, idx_mapping):
        moves = getattr(self, _MOVES, None)
        if moves is None or num_reqs == 0:
            return native(self, num_reqs, state_idx_gpu, src_col_gpu, token_bias_gpu, idx_mapping)
        rows = _rows(num_reqs, idx_mapping, state_idx_gpu.device)
        safe = rows.clamp(min=0)
        src_col, dst_col = src_col_gpu[safe].long(), state_idx_gpu[safe].long()
        if state_idx_gpu.is_cuda:
            align.migrate(moves, rows, src_col, dst_col)
            return native(self, num_reqs, state_idx_gpu, src_col_gpu, token_bias_gpu, idx_mapping)
        for r, s, d, bias in zip(rows.tolist(), src_col.tolist(), dst_col.tolist(), token_bias_gpu[safe].tolist()):
            if r >= 0 and 0 <= s != d:
                align.cpu_copy(moves, r, s, d, bias)
        align.migrate(moves, rows, src_col, dst_col)

    return functools.update_wrapper(run_fused_precopy, native)


def _rows(num_reqs, idx_mapping, device) -> torch.Tensor:
    """Each batch row's block-table row (V2: its request slot; V1: the batch row itself)."""
    if idx_mapping is None:
        return torch.arange(num_reqs, device=device)
    return idx_mapping[:num_reqs].long()


def make_postprocess_wrapper(native):
    """V1: decisions from this step's staged counts, in batch order."""

    def run_fused_postprocess(self, num_reqs, num_accepted_tokens_gpu, mamba_state_idx_gpu,
                              num_scheduled_tokens_gpu, num_computed_tokens_gpu, num_draft_tokens_gpu):
        moves = getattr(self, _MOVES, None)
        if moves is None or num_reqs == 0 or not self.is_initialized:
            return native(self, num_reqs, num_accepted_tokens_gpu, mamba_state_idx_gpu, num_scheduled_tokens_gpu,
                          num_computed_tokens_gpu, num_draft_tokens_gpu)
        n = num_reqs
        acc = num_accepted_tokens_gpu[:n].long()
        running = (num_computed_tokens_gpu[:n] + num_scheduled_tokens_gpu[:n] - num_draft_tokens_gpu[:n]).long()
        rows = torch.arange(n, device=acc.device)
        live = mamba_state_idx_gpu[:n].long()
        align.publish(moves, rows, live, acc, running + acc - 1)
        if acc.is_cuda:
            return native(self, num_reqs, num_accepted_tokens_gpu, mamba_state_idx_gpu, num_scheduled_tokens_gpu,
                          num_computed_tokens_gpu, num_draft_tokens_gpu)
        self.num_accepted_tokens_out[:n].copy_(num_accepted_tokens_gpu[:n])
        _cpu_postprocess(moves, rows, live, acc, running + acc - 1, self.num_accepted_tokens_out)

    return functools.update_wrapper(run_fused_postprocess, native)


def make_postprocess_align_wrapper(native):
    """V2: decisions from the post-step computed counts, rows mapped to request slots."""

    def run_fused_postprocess_align(self, num_reqs, num_accepted_tokens_gpu, state_idx_gpu,
                                    new_num_computed_tokens_gpu, idx_mapping):
        moves = getattr(self, _MOVES, None)
        if moves is None or num_reqs == 0 or not self.is_initialized:
            return native(self, num_reqs, num_accepted_tokens_gpu, state_idx_gpu, new_num_computed_tokens_gpu,
                          idx_mapping)
        rows = _rows(num_reqs, idx_mapping, state_idx_gpu.device)
        safe = rows.clamp(min=0)
        acc = num_accepted_tokens_gpu[safe].long()
        new = new_num_computed_tokens_gpu[safe].long()
        live = state_idx_gpu[safe].long()
        align.publish(moves, rows, live, acc, new)
        if state_idx_gpu.is_cuda:
            return native(self, num_reqs, num_accepted_tokens_gpu, state_idx_gpu, new_num_computed_tokens_gpu,
                          idx_mapping)
        _cpu_postprocess(moves, rows, live, acc, new, num_accepted_tokens_gpu)

    return functools.update_wrapper(run_fused_postprocess_align, native)


def _cpu_postprocess(moves, rows, live, acc, new, accepted_out) -> None:
    """vLLM's postprocess copies on CPU: where the accepted tokens reached a boundary, the
    copy-listed states go to the block that boundary completes, shifted by the accepted bias;
    where that block is the running one, the accepted count becomes 1 (`accepted_out`)."""
    crosses, dst_col, take = align.boundary(acc, new, moves.block_size)
    for r, cross, s, d, bias in zip(rows.tolist(), crosses.tolist(), live.tolist(), dst_col.tolist(),
                                     (take - 1).tolist()):
        if r < 0 or not cross:
            continue
        if s == d:
            accepted_out[r] = 1
            if bias == 0:
                continue
        align.cpu_copy(moves, r, s, d, bias)
