"""Self-contained GDN ReplaySSM kernels and their torch references (imports torch and triton only).

The public API is exported here. The Triton kernels load on first use, so the torch
references import (and run) where triton is missing or cannot initialise.

    kernels     ring_decode, ring_materialize, ring_reset, ring_verify, ring_commit;
                ucache_prepare, ucache_finish (the bookkeeping around FlashInfer's verify kernel);
                ring_flags (a step's per-row flags, for the metadata builder)
    launches    DecodeLaunch, VerifyLaunch, DECODE_TABLE, pick_decode_launch, override_launch
    references  ring_decode_reference, ring_materialize_reference, ring_reset_reference,
                ring_spec_verify_reference, ring_commit_pending_reference,
                recurrent_decode_reference, recurrent_sequence_reference
    cursor      pack_cursor, unpack_cursor (the verify kernels' packed cursor word)

Modules: decode (entry) with decode_fused / decode_two_phase / decode_replay (one per launch
form) and decode_shared; materialize; verify; ucache; ring_flags; launch (selection);
ring_reference and gdn_reference (float64-capable torch references); ring_checks (argument
checks); gdn_gates.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ring_decode": "decode",
    "ring_materialize": "materialize",
    "ring_reset": "materialize",
    "ring_verify": "verify",
    "ring_commit": "verify",
    "ucache_prepare": "ucache",
    "ucache_finish": "ucache",
    "ring_flags": "ring_flags",
    "DecodeLaunch": "launch",
    "VerifyLaunch": "launch",
    "DECODE_TABLE": "launch",
    "pick_decode_launch": "launch",
    "override_launch": "launch",
    "ring_decode_reference": "ring_reference",
    "ring_materialize_reference": "ring_reference",
    "ring_reset_reference": "ring_reference",
    "ring_spec_verify_reference": "ring_reference",
    "ring_commit_pending_reference": "ring_reference",
    "pack_cursor": "ring_reference",
    "unpack_cursor": "ring_reference",
    "recurrent_decode_reference": "gdn_reference",
    "recurrent_sequence_reference": "gdn_reference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
