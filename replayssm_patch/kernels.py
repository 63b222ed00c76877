"""Ring operations for the integration: the Triton kernels on CUDA; on CPU the torch reference,
and `cpu_ring` for the steps vLLM's CPU build takes (decode by its own kernel, the verify).

Also counts how often each operation ran in this process (`counters`), so tests and
`status()` can show that the ring path is really used.
"""

from __future__ import annotations

from collections import Counter

import torch

from . import ops as lib
from . import cpu_ring
from .numerics import FLA_NUMERICS, KernelNumerics

counters: Counter = Counter()


def gpu_kernels_available() -> tuple[bool, str]:
    try:
        from .ops import decode, verify  # noqa: F401 (loading them initialises triton)
    except Exception as e:  # ImportError, or triton failing to initialise
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def _cuda_numerics(numerics: KernelNumerics) -> None:
    if numerics != FLA_NUMERICS:
        raise ValueError(f"the CUDA ring kernels round as FLA's kernels do ({FLA_NUMERICS}), not {numerics}")


def decode(mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, ring, force_flush, start_empty,
           numerics: KernelNumerics = FLA_NUMERICS):
    """One decode token per row through the ring (see ops.decode_reference.ring_decode_reference).
    `numerics`: how the replaced vLLM kernel rounds (on CUDA only FLA_NUMERICS)."""
    if state.is_cuda:
        _cuda_numerics(numerics)  # refused before anything is counted or run
    counters["decode_calls"] += 1
    check_committed(ring, state_indices[: mixed_qkv.shape[0]])
    counters["decode_rows"] += int(mixed_qkv.shape[0])
    if state.is_cuda:
        result = lib.ring_decode(
            mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices,
            ring.d, ring.k, ring.g, ring.cursor,
            force_flush=force_flush, start_empty=start_empty, use_qk_l2norm=True,
        )
    else:
        result = lib.ring_decode_reference(
            mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices,
            ring.d, ring.k, ring.g, ring.cursor,
            force_flush=force_flush, start_empty=start_empty, use_qk_l2norm=True,
            beta_rounding=b.dtype if numerics.beta_in_input_dtype else None,
            l2norm_eps=numerics.l2norm_eps,
        )
        # reading the cursors back costs nothing on CPU: count flushes
        slots = state_indices[state_indices > 0].long()
        counters["flushes"] += int((ring.cursor[slots] == 0).sum())
    return result


def decode_with_cpu_kernel(native, params: dict, ring, force_flush, start_empty):
    """CPU: one decode token per row through the ring, the step taken by vLLM's CPU decode
    kernel `native` from each row's replayed state (cpu_ring.ring_decode); `params`: the named
    arguments of the call to `native`."""
    idx = params["initial_state_indices"][: params["q"].shape[1]]
    counters["decode_calls"] += 1
    check_committed(ring, idx)
    counters["decode_rows"] += int(idx.shape[0])
    result = cpu_ring.ring_decode(native, params, ring, force_flush, start_empty)
    counters["flushes"] += int((ring.cursor[idx[idx > 0].long()] == 0).sum())
    return result


def materialize(state, ring, slots, start_empty=None):
    """Flush the rings of `slots` (<= 0 ignored) into the checkpoint; a slot whose
    `start_empty` flag (one per entry of `slots`) is set drops its stale ring instead."""
    counters["materialize_calls"] += 1
    check_committed(ring, slots)
    fn = lib.ring_materialize if state.is_cuda else lib.ring_materialize_reference
    fn(state, ring.d, ring.k, ring.g, ring.cursor, slots, start_empty)


def compile_ahead(state, ring, speculative: bool) -> None:
    """CUDA: compile the ring's maintenance kernels now, at KV-cache binding. vLLM first calls
    them at a prefill, after its JIT monitor is on: a compile there is a latency spike, a warning,
    and an error under `--jit-monitor-mode=error`. Each runs on a one-entry slot list holding
    slot 0, which every one of them skips: nothing changes. `speculative`: also the MTP commit."""
    null = torch.zeros(1, dtype=torch.int32, device=state.device)  # vLLM's state indices are int32
    lib.ring_reset(ring.cursor, null)
    lib.ring_materialize(state, ring.d, ring.k, ring.g, ring.cursor, null)  # a prefill's flush
    lib.ring_materialize(state, ring.d, ring.k, ring.g, ring.cursor, null,  # a native decode's flush
                         torch.zeros(1, dtype=torch.int8, device=state.device))
    if speculative:
        L = ring.g.shape[-1]
        lib.ring_commit(ring.cursor, null, null, L)
        lib.ring_commit(ring.cursor, null, None, L)


def reset(ring, slots):
    """Empty the rings of `slots` (<= 0 ignored); the checkpoint is left as it is."""
    counters["reset_calls"] += 1
    fn = lib.ring_reset if ring.cursor.is_cuda else lib.ring_reset_reference
    fn(ring.cursor, slots)


# --------------------------------------------------------------------------------------------
# Speculative decoding: the cursor word holds `n | pending << 8` (ops/cursor.py), so a
# slot carries its uncommitted verify window between steps with no extra buffer.
# --------------------------------------------------------------------------------------------

def spec_verify(mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, cu_seqlens, ring,
                num_accepted, max_tokens, numerics: KernelNumerics = FLA_NUMERICS, flashinfer: bool = False):
    """One speculative step: commit each slot's previous window from `num_accepted`, then
    verify row i's tokens cu_seqlens[i]:cu_seqlens[i+1] (outputs for all of them) and keep
    their entries as the slot's new pending window. `state_indices` [rows], one slot per row.
    `flashinfer`: every row has exactly `max_tokens` tokens and FlashInfer's kernel serves the
    step (replayssm_patch.flashinfer_verify; CUDA only)."""
    # refused before anything is counted or run
    if state.is_cuda:
        _cuda_numerics(numerics)
    elif numerics.beta_in_input_dtype:
        raise ValueError("the verify reference computes beta in fp32, as vLLM's CPU MTP kernel does")
    rows = int(state_indices.shape[0])
    counters["verify_calls"] += 1
    counters["verify_rows"] += rows
    if flashinfer:
        if not state.is_cuda or mixed_qkv.shape[0] != rows * max_tokens:
            raise ValueError(f"FlashInfer's verify needs CUDA tensors and {rows} x {max_tokens} tokens "
                             f"(got {mixed_qkv.shape[0]} on {state.device})")
        from . import flashinfer_verify

        counters["verify_flashinfer_calls"] += 1
        return flashinfer_verify.verify(mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, ring,
                                        num_accepted, max_tokens)
    args = (mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, cu_seqlens,
            ring.d, ring.k, ring.g, ring.cursor, num_accepted, max_tokens)
    if state.is_cuda:
        return lib.ring_verify(*args, use_qk_l2norm=True)
    # the cursors are host memory on CPU: the verify counts its commits and flushes
    return cpu_ring.ring_verify(*args, use_qk_l2norm=True, l2norm_eps=numerics.l2norm_eps, counts=counters)


def commit(ring, slots, num_accepted):
    """Commit the pending windows of `slots` (<= 0 ignored) with `num_accepted` per slot
    (None: drop them); afterwards they hold the plain entry count decode/materialize use."""
    counters["commit_calls"] += 1
    L = ring.g.shape[-1]
    if ring.cursor.is_cuda:
        lib.ring_commit(ring.cursor, slots, num_accepted, L)
        return
    n, pending = lib.unpack_cursor(ring.cursor)
    lib.ring_commit_pending_reference(n, pending, slots, num_accepted, L)
    ring.cursor.copy_(lib.pack_cursor(n, pending))


def check_committed(ring, slots):
    """CPU guard: a path that reads the plain cursor must not meet a pending window."""
    if ring.cursor.is_cuda:
        return
    s = slots[slots > 0].long()
    if s.numel() and bool(lib.unpack_cursor(ring.cursor[s])[1].any()):
        raise RuntimeError(f"GDN ring: slots {s.tolist()} still hold an uncommitted verify window")
