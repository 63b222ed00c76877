"""Torch references of the commit (commit.py's `ring_commit`): making the accepted prefix of
the entries a verify step wrote past the cursor part of the replay history.

Speculative decoding with a delayed commit (one state slot per request): a verify step appends
its T_i + 1 tokens' entries past the cursor as *pending* and records the window length per slot
(`pending`, 0 = no window). The next step learns how many of them were accepted only from
vLLM's `num_accepted_tokens` (a GPU tensor, >= 1, the bonus token included), so the commit is
delayed: it runs at the start of the next step, before anything reads the slot. A slot without
a window (fresh prefill, or already committed) commits nothing, whatever num_accepted says
(vLLM passes 1 for a row after its prefill).

  * `ring_commit_pending_reference`  the delayed commit, what `ring_commit` does on the packed
                                     cursor word (n and pending as two tensors here; the word:
                                     cursor.pack_cursor / unpack_cursor)
  * `ring_commit_reference`          the plain commit n += accepted, the step after
                                     `verify_reference.ring_verify_reference`
"""

from __future__ import annotations

import torch

from .gdn_reference import valid_rows


def ring_commit_pending_reference(cursor, pending, state_indices, num_accepted, L=None):
    """Delayed commit: n += min(num_accepted, pending) where a window is pending; pending = 0.

    Rows with slot <= 0 are ignored. `num_accepted` may be None (nothing accepted: the window
    is dropped). The cursor never exceeds L (ring_g's length, when given).
    """
    rows = valid_rows(state_indices).nonzero().flatten()
    if rows.numel() == 0:
        return
    slots = state_indices[rows].long()
    p = pending[slots].long()
    acc = torch.zeros_like(p) if num_accepted is None else num_accepted[rows].long().clamp(min=0)
    n = cursor[slots].long() + torch.where(p > 0, torch.minimum(acc, p), torch.zeros_like(p))
    if L is not None:
        n = n.clamp(max=L)
    cursor[slots] = n.to(cursor.dtype)
    pending[slots] = 0



def ring_commit_reference(cursor, state_indices, num_accepted):
    """Commit the first num_accepted[i] pending entries of row i (slots <= 0 ignored)."""
    rows = valid_rows(state_indices).nonzero().flatten()
    slots = state_indices[rows].long()
    cursor[slots] = (cursor[slots] + num_accepted[rows].to(cursor.dtype)).to(cursor.dtype)
