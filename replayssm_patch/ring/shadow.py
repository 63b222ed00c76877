"""Shadow check (testing aid, CPU): run vLLM's own decode kernel beside the ring on a private
copy of every slot's exact state, and record how far the ring's outputs are from it.

On with VLLM_GDN_REPLAYSSM_SHADOW=1 (ReplayConfig.shadow): the layer then keeps the copy in
its RingBuffers (`shadow`), made at binding. The shadow copy is refreshed wherever the checkpoint
is exact by construction (after a prefill; at a row that starts a new block, whose state vLLM
copied from a flushed block), so the comparison follows the ring through every scheduling
path: flushes, prefix-cache blocks, mixed batches, preemption.

Poison (VLLM_GDN_REPLAYSSM_POISON_UNUSED=1, ReplayConfig.poison; also a testing aid, any platform): right after a
layer's ring buffers are bound, every slot's ring is filled with garbage and its cursor set to
a non-zero count. A correct integration never reads a ring it did not start itself (a prefill
resets its slots' rings; a row that starts a new block or has no prior state ignores the
cursor), so the poison changes nothing. Any path that reads a ring it did not start (a missing
reset, an ignored `ring_start_empty`, a freed block reused) replays the garbage into the state,
and the shadow check and the tokens show it. The garbage is finite (d = 1000, k = 1, G = 0,
values whose bf16 halves are finite too), because the ring's bytes share vLLM's hybrid page
with attention KV blocks; the shadow copy is untouched (it holds states, never rings).
"""

from __future__ import annotations

import math

import torch

POISON_D, POISON_K, POISON_G = 1000.0, 1.0, 0.0


def poison_rings(ring, stats) -> None:
    """Fill every slot's ring with garbage and give it a cursor in 1..L-1 (varying by slot)."""
    L = ring.g.shape[-1]
    ring.d.fill_(POISON_D)
    ring.k.fill_(POISON_K)
    ring.g.fill_(POISON_G)
    slots = torch.arange(ring.cursor.shape[0], device=ring.cursor.device)
    ring.cursor.copy_(1 + slots % max(L - 1, 1))
    stats["poisoned_slots"] += int(ring.cursor.shape[0])


def sync_slots(ring, state_kv: torch.Tensor, slots: torch.Tensor) -> None:
    """Copy the exact checkpoint of `slots` (> 0) into the shadow (in the kernels' [K, V] view)."""
    s = slots[slots > 0].long()
    ring.shadow[s] = state_kv[s]


def check_decode(native, params: dict, ring, ring_out: torch.Tensor, start_empty: torch.Tensor, stats) -> None:
    """Run vLLM's CPU decode on the shadow states and record the ring's relative error."""
    src, idx = params["initial_state_source"], params["initial_state_indices"]
    n = ring_out.shape[0]
    fresh = idx[:n][start_empty[:n].bool()]
    sync_slots(ring, src, fresh)
    shadow_out = native(**{**params, "initial_state_source": ring.shadow})
    valid = idx[:n] > 0
    a, b = ring_out[valid].float(), shadow_out[valid].float()
    if b.numel():
        err = float((a - b).norm() / b.norm().clamp_min(1e-30))
        if not math.isfinite(err):  # NaN/inf on either side: record it as a huge error
            stats["shadow_nonfinite"] += 1
            err = 1e6
        stats["shadow_checks"] += 1
        worst = stats.get("shadow_max_rel_err_x1e6", 0)
        stats["shadow_max_rel_err_x1e6"] = max(worst, int(err * 1e6))
