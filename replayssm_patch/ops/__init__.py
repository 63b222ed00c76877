"""The GDN ReplaySSM ops: Triton kernels, their launchers and their torch references (imports
torch and triton only).

The public API is exported here. The Triton kernels load on first use, so the torch
references import (and run) where triton is missing or cannot initialise.

One file per op, its torch reference beside it (<op>_reference.py):

    decode.py                ring_decode: the entry (checks, launch pick); one file per launch
                             form (decode_fused, decode_two_phase, decode_replay, decode_tma,
                             decode_tma_tc), the prep kernel three of them run (decode_prep) and
                             what they share (decode_shared)
    verify.py                ring_verify: one MTP verify step, with the delayed commit
    commit.py                ring_commit: the delayed commit alone
    materialize.py           ring_materialize, ring_reset
    publish.py               ring_publish: a slot's (prefix) state into other slots'
                             checkpoints, many layers per launch (prefix caching with MTP)

Beside them:

    cursor.py                the cursor word's format: the fields' masks and shifts (every
                             kernel names its bit operations with them), pack_cursor /
                             unpack_cursor
    ring_state_reference.py  the ring's layout and the state it stands for (the references' base)
    gdn_reference.py         the GDN recurrence as vLLM computes it (recurrent_decode_reference)
    launch.py                DecodeLaunch, VerifyLaunch, DECODE_TABLE, pick_decode_launch,
                             override_launch
    ring_checks.py           the launchers' argument checks
    gdn_gates.py             the GDN gates in Triton

Integration kernels (they encode vLLM's or FlashInfer's semantics; not ring ops):

    ring_flags.py            ring_flags: a step's per-row flags from vLLM's metadata (for the
                             metadata builder)
    ucache.py                ucache_prepare, ucache_finish: the bookkeeping around FlashInfer's
                             verify kernel
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ring_decode": "decode",
    "ring_verify": "verify",
    "ring_commit": "commit",
    "ring_materialize": "materialize",
    "ring_reset": "materialize",
    "ring_publish": "publish",
    "ring_table": "publish",
    "RingTable": "publish",
    "ring_flags": "ring_flags",
    "ucache_prepare": "ucache",
    "ucache_finish": "ucache",
    "DecodeLaunch": "launch",
    "VerifyLaunch": "launch",
    "DECODE_TABLE": "launch",
    "pick_decode_launch": "launch",
    "override_launch": "launch",
    "ring_decode_reference": "decode_reference",
    "ring_spec_verify_reference": "verify_reference",
    "ring_commit_pending_reference": "commit_reference",
    "ring_materialize_reference": "materialize_reference",
    "ring_reset_reference": "materialize_reference",
    "ring_publish_reference": "publish_reference",
    "recurrent_decode_reference": "gdn_reference",
    "recurrent_sequence_reference": "gdn_reference",
    "pack_cursor": "cursor",
    "unpack_cursor": "cursor",
}

__all__ = sorted(_EXPORTS)


def kernels_available() -> tuple[bool, str]:
    """Whether the Triton kernels can load here (triton imports and finds a GPU driver), and why not."""
    try:
        import triton

        triton.runtime.driver.active.get_current_target()
    except Exception as e:  # ImportError, or no driver Triton can use
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
