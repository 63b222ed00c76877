"""Ring operations for the integration: the Triton kernels on CUDA, the torch reference on CPU.

Also counts how often each operation ran in this process (`counters`), so tests and
`status()` can show that the ring path is really used.
"""

from __future__ import annotations

from collections import Counter


from ._vendored import ring_reference as ref

counters: Counter = Counter()


def gpu_kernels_available() -> tuple[bool, str]:
    try:
        from ._vendored import ring_decode as _  # noqa: F401
    except Exception as e:  # ImportError, or triton failing to initialise
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def _gpu():
    from ._vendored import ring_decode

    return ring_decode


def decode(mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, ring, force_flush, start_empty):
    """One decode token per row through the ring (see ring_reference.ring_decode_reference)."""
    counters["decode_calls"] += 1
    counters["decode_rows"] += int(mixed_qkv.shape[0])
    fn = _gpu().ring_decode if state.is_cuda else ref.ring_decode_reference
    result = fn(
        mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices,
        ring.d, ring.k, ring.g, ring.cursor,
        force_flush=force_flush, start_empty=start_empty, use_qk_l2norm=True,
    )
    if not state.is_cuda:  # reading the cursors back costs nothing on CPU: count flushes
        slots = state_indices[state_indices > 0].long()
        counters["flushes"] += int((ring.cursor[slots] == 0).sum())
    return result


def materialize(state, ring, slots):
    """Flush the rings of `slots` (<= 0 ignored) into the checkpoint."""
    counters["materialize_calls"] += 1
    fn = _gpu().ring_materialize if state.is_cuda else ref.ring_materialize_reference
    fn(state, ring.d, ring.k, ring.g, ring.cursor, slots)


def reset(ring, slots):
    """Empty the rings of `slots` (<= 0 ignored); the checkpoint is left as it is."""
    counters["reset_calls"] += 1
    fn = _gpu().ring_reset if ring.cursor.is_cuda else ref.ring_reset_reference
    fn(ring.cursor, slots)
