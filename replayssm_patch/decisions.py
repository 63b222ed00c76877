"""What the patch decided in this process: the options in force, the plan for each model
config (with its one log line), and each GDN layer's decision.

The layer asks `current_plan` while vLLM builds the model; `patching.apply` sets the options.
Every decision is taken from the `VllmConfig` and the options alone, so the layer and the
model-class page-size hook reach the same answer.
"""

from __future__ import annotations

import logging

from . import model_hooks, options as opts_mod, ring_plan

logger = logging.getLogger("vllm.replayssm_patch")
state: dict = {"options": None}  # the options in force (set by patching.apply)
layer_report: dict[str, str] = {}  # GDN layer prefix -> "ring" or "native: <reason>"
_logged: set = set()


class PatchRefused(RuntimeError):
    """Strict mode: the patch could not be applied (the message says why)."""


def log_once(level, msg) -> None:
    if msg not in _logged:
        _logged.add(msg)
        logger.log(level, msg)


def platform() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    return type(current_platform).__name__


def _ring_extra(vllm_config):
    plan, _ = ring_plan.plan_for(vllm_config, state["options"])
    return None if plan is None else (plan.shapes, plan.dtypes, plan.gdn_state_shape)


def current_plan(vllm_config):
    """Ring plan for a model config in this process, with the page-size hooks in place."""
    options = state["options"] or opts_mod.Options()
    plan, reasons = ring_plan.plan_for(vllm_config, options)
    if plan is not None:
        ok, why = model_hooks.ensure(vllm_config, _ring_extra)
        if not ok:
            plan, reasons = None, [why]
    arch = getattr(vllm_config.model_config, "architecture", "model")
    if plan is None:
        msg = f"replayssm_patch: {arch} GDN layers use vLLM's native decode: " + "; ".join(reasons)
        if ring_plan.only_by_choice(reasons):
            # native by default (an opt-in is off): not a fallback, so INFO and no strict error
            log_once(logging.INFO, msg)
        elif options.strict and options.enabled:
            raise PatchRefused(msg)
        else:
            log_once(logging.WARNING, msg)
    else:
        if plan.spec_tokens:
            kernel = f", verify kernel: {plan.verify_kernel}" if platform() == "cuda" else ""
            log_once(logging.INFO, f"replayssm_patch: MTP speculative decoding (T={plan.spec_tokens}) "
                     f"goes through the ring on {platform().upper()}, one state slot per request "
                     f"(opted in with VLLM_GDN_REPLAYSSM_MTP=1){kernel}")
        when = "every speculative step" if plan.spec_tokens else f"plain decode steps of >= {plan.min_batch} rows"
        log_once(logging.INFO, f"replayssm_patch: {arch} GDN layers decode through the ring "
                 f"(L={plan.ring_len}, ring {plan.ring_dtype}, state {plan.state_dtype}, {when}, "
                 f"+{plan.bytes_per_slot} bytes per layer per cache slot)")
    return plan, reasons
