"""The cursor word: one int32 per slot telling how much of the slot's ring is live. Its format
is defined here only; kernels and launchers name its fields with the constants below.

    bits  0-7    n         committed entries
    bits  8-15   pending   entries of a verify window written past n, not yet committed
    bits 16-31   tickets   arrivals, only while a kernel that takes tickets is in flight

The decode view: `ring_decode` and `ring_materialize` read bits 0-15 as n (`DECODE_MASK`),
which a slot without a pending window holds alone, up to 0xFFFF entries. The speculative
kernels (`ring_verify`, `ring_commit`, ucache) keep n and pending below 256 (`COUNT_MASK`); a
slot with a pending window must be committed (`ring_commit`, or the next `ring_verify`) before
decode or materialise reads it.

Tickets: when every program of a slot must read its word before any may rewrite it, each takes
the word with one relaxed atomic add of `TICKET` (bits 0-15 unchanged by it); the program that
counts every other program's arrival (word >> `TICKET_SHIFT`) writes the new word, tickets
cleared, with an exchange. No grid barrier, no second kernel, no host sync; between launches
no tickets remain. Who takes them: decode_fused, materialize, and verify's finish kernel.

The two-phase decode forms hand a row's (n, flush) from their prep kernel to their main kernel
as one scratch word of the same layout: n in the decode view, the flush flag at `TICKET_SHIFT`.

Every constant is a Python int (the launchers' checks, and the torch half, which the CPU build
uses where triton is missing) and, with triton, the same value as a Triton constexpr under the
name with `_C` appended: a kernel reads a module global only as a constexpr (which also puts
its value in the kernel's cache key). Kernels write the bit operations themselves with these
names rather than calling Triton helper functions: an inlined Triton function adds DWARF
inlined-subroutine labels to the PTX, and with them ptxas allocated registers differently in
some kernels (benchmarks/results/sass_compare_2026-12-05/).
"""

from __future__ import annotations

import torch

COUNT_MASK = 0xFF  # n in the packed word; also the longest ring the speculative kernels take
PENDING_SHIFT = 8
PENDING_MASK = 0xFF  # the pending window's length, after the shift
DECODE_MASK = 0xFFFF  # n in the decode view; also the longest ring decode and materialise take
TICKET_SHIFT = 16
TICKET = 1 << TICKET_SHIFT
MAX_TICKETS = 1 << (31 - TICKET_SHIFT)  # programs per slot that may take a ticket (bit 31 stays clear)


def pack_cursor(n: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
    """The packed cursor word from the (n, pending) pair (int32)."""
    return (n.to(torch.int32) | (pending.to(torch.int32) << PENDING_SHIFT)).to(torch.int32)


def unpack_cursor(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, pending) from packed cursor words (new tensors)."""
    return word & COUNT_MASK, (word >> PENDING_SHIFT) & PENDING_MASK


try:
    import triton.language as tl
except ImportError:  # the CPU build may run without triton: it uses the ints above only
    tl = None

if tl is not None:
    COUNT_MASK_C = tl.constexpr(COUNT_MASK)
    PENDING_SHIFT_C = tl.constexpr(PENDING_SHIFT)
    PENDING_MASK_C = tl.constexpr(PENDING_MASK)
    DECODE_MASK_C = tl.constexpr(DECODE_MASK)
    TICKET_SHIFT_C = tl.constexpr(TICKET_SHIFT)
    TICKET_C = tl.constexpr(TICKET)
