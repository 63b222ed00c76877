"""What a worker's GDN layers hold beside the KV cache vLLM accounted for (run in the worker
through `LLM.collective_rpc(cache_memory_report)`).

vLLM budgets the KV cache from a profile and then allocates exactly that; anything a layer
keeps alive outside it is memory nobody accounted for. Two ways the ring could do that:

* its views outliving the pages they point into: vLLM binds a minimal KV cache to capture
  CUDA graphs while it profiles their memory, then releases it (`_cleanup_profiling_kv_cache`
  / `clear_layer_kv_caches`) before allocating the real one; a view kept by the layer keeps that
  whole cache alive;
* tensors of its own beside the pages (the cursor words).

The report runs that profiling cycle on the worker's runner (the CPU runner inherits it from
vLLM's GPU runner) and so leaves the engine without a KV cache: call it last.
"""

from __future__ import annotations

import gc


def _storages(tensors) -> dict[int, int]:
    """data_ptr -> bytes of the storages behind `tensors` (nested lists / tuples allowed)."""
    import torch

    out = {}
    stack = list(tensors)
    while stack:
        t = stack.pop()
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.nbytes():
                out[s.data_ptr()] = s.nbytes()
        elif isinstance(t, (list, tuple)):
            stack.extend(t)
    return out


def _live_tensors_on(storage_ptrs) -> list:
    """Every tensor the garbage collector can see whose storage is one of `storage_ptrs`."""
    import torch

    found = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.untyped_storage().data_ptr() in storage_ptrs:
                found.append(obj)
        except (RuntimeError, ReferenceError):  # a tensor without storage (meta, freed)
            continue
    return found


def cache_memory_report(worker) -> dict:
    """Bytes the ring layers hold outside vLLM's KV cache now, and after vLLM's profiling
    cache is bound and released; see the module docstring."""
    runner = worker.model_runner
    layers = [m for m in runner.compilation_config.static_forward_context.values()
              if getattr(m, "replay_ring", None) is not None]
    kv = _storages(runner.kv_caches)
    outside = own = 0
    for layer in layers:
        ring = layer.replay_ring
        for t in (ring.g, ring.d, ring.k):
            if t.untyped_storage().data_ptr() not in kv:
                outside += t.untyped_storage().nbytes()
        own += ring.cursor.untyped_storage().nbytes()
    num_blocks = runner.kv_cache_config.num_blocks
    runner._cleanup_profiling_kv_cache()  # vLLM profiles before its real cache exists

    cc = runner.compilation_config
    saved = cc.max_cudagraph_capture_size
    if saved is None:  # no graphs on CPU: size the profiling cache as a CUDA engine would
        cc.max_cudagraph_capture_size = runner.max_num_reqs
    try:
        runner._init_minimal_kv_cache_for_profiling()
    finally:
        cc.max_cudagraph_capture_size = saved
    profiling = _storages(runner.kv_caches)
    profiling_bytes = sum(profiling.values())
    rings_bound = sum(getattr(m, "replay_ring", None) is not None
                      for m in runner.compilation_config.static_forward_context.values())
    runner._cleanup_profiling_kv_cache()
    gc.collect()
    kept = _live_tensors_on(profiling)
    kept_bytes = sum(profiling[p] for p in {t.untyped_storage().data_ptr() for t in kept})
    return {"ring_layers": len(layers), "num_blocks": num_blocks,
            "ring_views_outside_kv_cache_bytes": outside, "cursor_bytes": own,
            "profiling_cache_bytes": profiling_bytes, "ring_layers_bound_in_profiling": rings_bound,
            "profiling_cache_kept_bytes": kept_bytes, "profiling_cache_kept_tensors": len(kept)}
