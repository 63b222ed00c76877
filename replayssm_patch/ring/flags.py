"""A step's per-row ring flags, for the metadata builder (vllm.gdn_backend).

  force_flush  the step completes a prefix-cache block (align mode): the ring must be empty at
               every block boundary, because vLLM moves only conv and SSM state between blocks;
  start_empty  the row starts a new block (align) or has no prior state: its slot's state was
               put there without a ring, so any cursor there is stale.

On CUDA one launch (ops' ring_flags), where each torch op below would be one, paid every step on
the host; tests/test_ring_flags_interpret.py checks the two agree.
"""

from __future__ import annotations

import torch


def fill_flags(qsl, seq, force, empty, rows: int, block_size: int | None) -> None:
    """Rows 0..rows-1 of the flag buffers from `query_start_loc` and `seq_lens` (tokens computed
    after this step); `block_size`: the prefix-cache block in align mode, else None."""
    if force.is_cuda:
        from ..ops.ring_flags import ring_flags  # the function (the package's attribute may be the module)

        ring_flags(qsl, seq, force, empty, rows, block_size)
        return
    computed = seq - (qsl[1:] - qsl[:-1])  # tokens computed before this step
    force, empty = force[:rows], empty[:rows]
    if block_size is None:
        force.zero_()
        empty.copy_(computed == 0)
    else:
        force.copy_(torch.remainder(seq, block_size) == 0)
        empty.copy_(torch.remainder(computed, block_size) == 0)
