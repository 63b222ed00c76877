"""The ring's buffers and its operations, chosen once per platform: `ops_for(platform, stats)`.

`CudaRingOps` runs the Triton kernels (and FlashInfer's verify where the plan chose it);
`CpuRingOps` the torch references, and `ring.cpu` for the steps vLLM's CPU build takes (decode by
its own kernel, the verify in matrix-vector form). Both count what they run into `stats` (the
process's counters, `status()["counters"]`), so tests and users can see the ring at work.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from .. import ops as lib
from ..ops.commit_reference import ring_commit_pending_reference
from ..ops.cursor import pack_cursor, unpack_cursor
from ..ops.decode_reference import ring_decode_reference
from ..ops.materialize_reference import ring_materialize_reference, ring_reset_reference
from . import cpu
from .numerics import FLA_NUMERICS, KernelNumerics


@dataclass
class RingBuffers:
    """One layer's ring: views into its cache pages, and the slots' cursor words."""

    g: torch.Tensor  # [slots, HV, L] float32, cumulative log-decay
    d: torch.Tensor  # [slots, HV, L, V]
    k: torch.Tensor  # [slots, H, L, K]
    cursor: torch.Tensor  # [slots] int32: committed entries n | pending verify window << 8
    shadow: torch.Tensor | None = None  # exact-state copy for the shadow check (testing aid)


class CudaRingOps:
    """The ring's operations on CUDA: one launch each, no host sync (CUDA-graph safe)."""

    def __init__(self, stats: Counter):
        self.stats = stats

    def decode(self, mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, ring, force_flush,
               start_empty, numerics: KernelNumerics = FLA_NUMERICS):
        """One decode token per row through the ring (ring_reference.ring_decode_reference's semantics)."""
        _check_cuda_numerics(numerics)
        self.stats["decode_calls"] += 1
        self.stats["decode_rows"] += int(mixed_qkv.shape[0])
        return lib.ring_decode(mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices,
                               ring.d, ring.k, ring.g, ring.cursor, force_flush=force_flush,
                               start_empty=start_empty, use_qk_l2norm=True)

    def materialize(self, state, ring, slots, start_empty=None):
        """Flush the rings of `slots` (<= 0 ignored) into their checkpoints; a slot whose
        `start_empty` flag is set drops its stale ring instead."""
        self.stats["materialize_calls"] += 1
        lib.ring_materialize(state, ring.d, ring.k, ring.g, ring.cursor, slots, start_empty)

    def reset(self, ring, slots):
        """Empty the rings of `slots` (<= 0 ignored); the checkpoints stay as they are."""
        self.stats["reset_calls"] += 1
        lib.ring_reset(ring.cursor, slots)

    def verify(self, mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, cu_seqlens, ring,
               num_accepted, window, numerics: KernelNumerics = FLA_NUMERICS, flashinfer: bool = False):
        """One MTP verify step: commit each slot's previous window by `num_accepted`, then verify
        row i's tokens cu_seqlens[i]:cu_seqlens[i+1] and keep their entries pending. `flashinfer`:
        every row has exactly `window` tokens and FlashInfer's kernel serves the step."""
        _check_cuda_numerics(numerics)
        rows = int(state_indices.shape[0])
        self.stats["verify_calls"] += 1
        self.stats["verify_rows"] += rows
        if flashinfer:
            if mixed_qkv.shape[0] != rows * window:
                raise ValueError(f"FlashInfer's verify needs {rows} x {window} tokens (got {mixed_qkv.shape[0]})")
            from . import flashinfer as fi

            self.stats["verify_flashinfer_calls"] += 1
            return fi.verify(mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, ring,
                             num_accepted, window)
        return lib.ring_verify(mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, cu_seqlens,
                               ring.d, ring.k, ring.g, ring.cursor, num_accepted, window, use_qk_l2norm=True)

    def commit(self, ring, slots, num_accepted):
        """Commit the pending windows of `slots` (<= 0 ignored) by `num_accepted` (None: drop them)."""
        self.stats["commit_calls"] += 1
        lib.ring_commit(ring.cursor, slots, num_accepted, ring.g.shape[-1])

    def compile_ahead(self, state, ring, speculative: bool) -> None:
        """Compile the maintenance kernels now, at KV-cache binding: vLLM first calls them at a
        prefill, after its JIT monitor is on (a latency spike, a warning, an error under
        --jit-monitor-mode=error). Each runs on slot 0 alone, which every one of them skips."""
        null = torch.zeros(1, dtype=torch.int32, device=state.device)  # vLLM's state indices are int32
        lib.ring_reset(ring.cursor, null)
        lib.ring_materialize(state, ring.d, ring.k, ring.g, ring.cursor, null)  # a prefill's flush
        lib.ring_materialize(state, ring.d, ring.k, ring.g, ring.cursor, null,  # a native decode's flush
                             torch.zeros(1, dtype=torch.int8, device=state.device))
        if speculative:
            L = ring.g.shape[-1]
            lib.ring_commit(ring.cursor, null, null, L)
            lib.ring_commit(ring.cursor, null, None, L)


class CpuRingOps:
    """The ring's operations on CPU: the torch references, whose cursors are host memory (so they
    also count flushes and check that no path reads a slot with an uncommitted window)."""

    def __init__(self, stats: Counter):
        self.stats = stats

    def decode(self, mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, ring, force_flush,
               start_empty, numerics: KernelNumerics = FLA_NUMERICS):
        self.stats["decode_calls"] += 1
        self._check_committed(ring, state_indices[: mixed_qkv.shape[0]])
        self.stats["decode_rows"] += int(mixed_qkv.shape[0])
        result = ring_decode_reference(
            mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, ring.d, ring.k, ring.g, ring.cursor,
            force_flush=force_flush, start_empty=start_empty, use_qk_l2norm=True,
            beta_rounding=b.dtype if numerics.beta_in_input_dtype else None, l2norm_eps=numerics.l2norm_eps)
        slots = state_indices[state_indices > 0].long()
        self.stats["flushes"] += int((ring.cursor[slots] == 0).sum())
        return result

    def decode_with_kernel(self, native, params: dict, ring, force_flush, start_empty):
        """One decode token per row, the step taken by vLLM's CPU kernel `native` from each row's
        replayed state (ring.cpu.ring_decode); `params`: the named arguments of the call."""
        idx = params["initial_state_indices"][: params["q"].shape[1]]
        self.stats["decode_calls"] += 1
        self._check_committed(ring, idx)
        self.stats["decode_rows"] += int(idx.shape[0])
        result = cpu.ring_decode(native, params, ring, force_flush, start_empty)
        self.stats["flushes"] += int((ring.cursor[idx[idx > 0].long()] == 0).sum())
        return result

    def materialize(self, state, ring, slots, start_empty=None):
        self.stats["materialize_calls"] += 1
        self._check_committed(ring, slots)
        ring_materialize_reference(state, ring.d, ring.k, ring.g, ring.cursor, slots, start_empty)

    def reset(self, ring, slots):
        self.stats["reset_calls"] += 1
        ring_reset_reference(ring.cursor, slots)

    def verify(self, mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, cu_seqlens, ring,
               num_accepted, window, numerics: KernelNumerics = FLA_NUMERICS, flashinfer: bool = False):
        if flashinfer:
            raise ValueError("FlashInfer's verify kernel runs on CUDA only")
        if numerics.beta_in_input_dtype:
            raise ValueError("the CPU verify computes beta in fp32, as vLLM's CPU MTP kernel does")
        self.stats["verify_calls"] += 1
        self.stats["verify_rows"] += int(state_indices.shape[0])
        return cpu.ring_verify(mixed_qkv, a, b, A_log, dt_bias, scale, state, out, state_indices, cu_seqlens,
                               ring.d, ring.k, ring.g, ring.cursor, num_accepted, window, use_qk_l2norm=True,
                               l2norm_eps=numerics.l2norm_eps, counts=self.stats)

    def commit(self, ring, slots, num_accepted):
        self.stats["commit_calls"] += 1
        n, pending = unpack_cursor(ring.cursor)
        ring_commit_pending_reference(n, pending, slots, num_accepted, ring.g.shape[-1])
        ring.cursor.copy_(pack_cursor(n, pending))

    def compile_ahead(self, state, ring, speculative: bool) -> None:
        """Nothing to compile on CPU."""

    @staticmethod
    def _check_committed(ring, slots):
        """A path that reads the plain cursor must not meet a pending verify window."""
        s = slots[slots > 0].long()
        if s.numel() and bool(unpack_cursor(ring.cursor[s])[1].any()):
            raise RuntimeError(f"GDN ring: slots {s.tolist()} still hold an uncommitted verify window")


def ops_for(platform: str, stats: Counter):
    """The ring's operations on `platform` ("cuda" or "cpu")."""
    return CudaRingOps(stats) if platform == "cuda" else CpuRingOps(stats)


def _check_cuda_numerics(numerics: KernelNumerics) -> None:
    if numerics != FLA_NUMERICS:
        raise ValueError(f"the CUDA ring kernels round as FLA's kernels do ({FLA_NUMERICS}), not {numerics}")
