"""Every change the patch makes to vLLM, declared once.

Each entry of POINTS names the vLLM module and attribute it replaces, what replaces it, on which
platform, whether vLLM must have it, the source probes that must pass before anything changes,
and one line each of why, how and when it can go. `install` / `revert`, the probes
(`run_probes`) and status()["patched"] all come from this list.

Kinds of change:
  "register_oot"  the attribute is a layer class; the replacement is registered as its
                  out-of-tree class (vLLM builds it wherever the class is instantiated)
  "wrap"          module.attribute = factory(native): the replacement wraps vLLM's function
  "model_class"   installed by model_hooks.ensure on the served model class when the first
                  ring layer is built (the class is known only then); listed for the record,
                  reverted with the rest
"""

from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

from .versions import (
    CPU_GDN,
    CUSTOM_OP,
    CUSTOM_OPS,
    GDN_BUILDER,
    KV_IFACE,
    MAMBA_ABSTRACT,
    QWEN_GDN,
    Probe,
    dataclass_fields,
    has_method,
    imports_name,
    installed_source,
    registers_op,
)

QWEN_GDN_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
CPU_GDN_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
LAYER_CLASS = "QwenGatedDeltaNetAttention"


@dataclass(frozen=True)
class PatchPoint:
    kind: str  # "register_oot" | "wrap" | "model_class"
    module: str  # the vLLM module holding the attribute
    attribute: str
    replacement: str  # "module:name" in this package: the layer class, or the wrapper factory
    why: str
    how: str
    remove_when: str
    platform: str = "any"  # "any" | "cpu"
    required: bool = True  # False: skipped where this vLLM build lacks the attribute
    probes: tuple[Probe, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"


CPU_UPDATE_PARAMS = ["A_log", "dt_bias", "q", "k", "v", "a", "b", "initial_state_source",
                     "initial_state_indices", "cu_seqlens", "use_qk_l2norm_in_kernel"]

POINTS = (
    PatchPoint(
        "register_oot", QWEN_GDN_MODULE, LAYER_CLASS, "replayssm_patch.layer:ReplayQwenGDN",
        why="the ring needs its tensors in the layer's cache page, its flags in the metadata and its "
            "kernels in the decode path; Olmo and Kimi GDN layers are other classes and stay native",
        how="a subclass extends get_kv_cache_spec / bind_kv_cache with the ring, returns a backend whose "
            "builder adds the ring fields, and runs vLLM's own _forward_core inside a ring call (on CUDA, "
            "a step of speculative rows alone makes vLLM's conv-update call and the ring's verify itself: "
            "intercept.verify_step)",
        remove_when="vLLM ships GDN ReplaySSM itself (the seed PR's FlashInfer path)",
        probes=(
            Probe("layer _forward_core", QWEN_GDN, has_method(LAYER_CLASS, "_forward_core",
                                                              ["self", "mixed_qkv", "b", "a", "core_attn_out"],
                                                              exact=True)),
            Probe("layer get_state_shape", QWEN_GDN, has_method(LAYER_CLASS, "get_state_shape")),
            Probe("GDN core custom op", QWEN_GDN, registers_op("qwen_gdn_attention_core")),
            Probe("builder build()", GDN_BUILDER, has_method(
                "GDNAttentionMetadataBuilder", "build",
                ["self", "common_prefix_len", "common_attn_metadata", "num_accepted_tokens",
                 "num_decode_draft_tokens_cpu", "fast_build"], exact=True)),
            Probe("GDN metadata fields", GDN_BUILDER, dataclass_fields(
                "GDNAttentionMetadata", ["num_prefills", "num_decodes", "num_spec_decodes", "has_initial_state",
                                         "non_spec_state_indices_tensor", "spec_sequence_masks"])),
            Probe("MambaBase.bind_kv_cache", MAMBA_ABSTRACT,
                  has_method("MambaBase", "bind_kv_cache", ["self", "kv_cache"])),
            Probe("MambaBase.get_kv_cache_spec", MAMBA_ABSTRACT, has_method("MambaBase", "get_kv_cache_spec")),
            Probe("MambaSpec fields", KV_IFACE, dataclass_fields("MambaSpec", ["shapes", "dtypes", "page_size_padded"])),
            Probe("PluggableLayer.register_oot", CUSTOM_OP, has_method("PluggableLayer", "register_oot")),
        )),
    PatchPoint(
        "wrap", QWEN_GDN_MODULE, "fused_recurrent_gated_delta_rule_packed_decode",
        "replayssm_patch.intercept:make_packed_decode_wrapper",
        why="vLLM's decode recurrence for pure decode batches on CUDA: the call the ring replaces",
        how="passes through unless a ring call is active for the state it was given; then the ring kernel",
        remove_when="as the layer class",
        probes=(Probe("packed decode kernel import", QWEN_GDN,
                      imports_name("fused_recurrent_gated_delta_rule_packed_decode")),)),
    PatchPoint(
        "wrap", QWEN_GDN_MODULE, "fused_sigmoid_gating_delta_rule_update",
        "replayssm_patch.intercept:make_sigmoid_update_wrapper",
        why="the recurrence of mixed batches' decode rows and, with num_accepted_tokens, the MTP verify on CUDA",
        how="decode rows go to the ring decode, verify calls to the ring verify; anything else passes through "
            "after its rows' rings are flushed",
        remove_when="as the layer class",
        probes=(Probe("sigmoid-gating update import", QWEN_GDN,
                      imports_name("fused_sigmoid_gating_delta_rule_update")),)),
    PatchPoint(
        "wrap", CPU_GDN_MODULE, "_cpu_gdn_attention_nonspec", "replayssm_patch.layer:make_cpu_nonspec_wrapper",
        platform="cpu",
        why="the CPU build runs the GDN core here, not through _forward_core",
        how="the same ring bookkeeping as _forward_core (commit, flush prefill rows, reset after prefill)",
        remove_when="vLLM's CPU path goes through _forward_core, or ships the ring",
        probes=(Probe("CPU GDN non-spec path", CPU_GDN,
                      has_method(None, "_cpu_gdn_attention_nonspec", ["layer", "attn_metadata_i"])),)),
    PatchPoint(
        "wrap", "vllm._custom_ops", "fused_sigmoid_gating_delta_rule_update_cpu",
        "replayssm_patch.intercept:make_cpu_update_wrapper", platform="cpu",
        why="vLLM's CPU decode recurrence",
        how="the ring's step, taken by this very kernel from each row's replayed state (cpu_ring)",
        remove_when="as the CPU path",
        probes=(Probe("CPU decode kernel", CUSTOM_OPS,
                      has_method(None, "fused_sigmoid_gating_delta_rule_update_cpu", CPU_UPDATE_PARAMS)),)),
    PatchPoint(
        "wrap", CPU_GDN_MODULE, "_cpu_gdn_attention_spec_aware", "replayssm_patch.layer:make_cpu_nonspec_wrapper",
        platform="cpu", required=False,
        why="the CPU build's GDN core with speculative decoding (absent from older builds: MTP stays native)",
        how="the same ring bookkeeping as the non-spec path; its kernels go through the wrappers here",
        remove_when="as the CPU path"),
    PatchPoint(
        "wrap", "vllm._custom_ops", "fused_sigmoid_gating_delta_rule_update_spec_cpu",
        "replayssm_patch.intercept:make_cpu_spec_update_wrapper", platform="cpu", required=False,
        why="vLLM's CPU MTP recurrence (1+T state slots per request)",
        how="the ring's verify step: commit the previous window, verify, keep the new window pending",
        remove_when="as the CPU path"),
    PatchPoint(
        "model_class", "vllm.model_executor.models.<served model class>",
        "get_mamba_specs_from_config (vLLM >= 0.31) or get_mamba_state_{shape,dtype}_from_config",
        "replayssm_patch.model_hooks:ensure",
        why="vLLM sizes the hybrid page from the model class, apart from the layers' specs: both must "
            "include the ring or MambaSpec.page_size_bytes asserts",
        how="the served class's hook appends the ring's shapes and dtypes to its GDN spec (found by shape)",
        remove_when="as the layer class"),
)


def _resolve(ref: str):
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def points_for(platform: str) -> tuple[PatchPoint, ...]:
    return tuple(p for p in POINTS if p.platform in ("any", platform))


def run_probes(read_source: Callable[[str], str | None] = installed_source, cpu: bool = False) -> list[str]:
    """The failed probes of the patch points for this platform (empty: all look as expected).
    `read_source(path)` gives a vLLM source file's text (the installed one, or a wheel's)."""
    failures, trees = [], {}
    for point in points_for("cpu" if cpu else "cuda"):
        for probe in point.probes:
            if probe.path not in trees:
                text = read_source(probe.path)
                trees[probe.path] = ast.parse(text) if text is not None else None
            tree = trees[probe.path]
            why = f"{probe.path} missing" if tree is None else probe.check(tree)
            if why:
                failures.append(f"{probe.name}: {why}")
    return failures


WRAPPED_PARAMS = {
    "fused_recurrent_gated_delta_rule_packed_decode":
        ["mixed_qkv", "a", "b", "A_log", "dt_bias", "scale", "initial_state", "out", "ssm_state_indices",
         "use_qk_l2norm_in_kernel"],
    "fused_sigmoid_gating_delta_rule_update":
        ["A_log", "a", "b", "dt_bias", "q", "k", "v", "initial_state", "inplace_final_state", "cu_seqlens",
         "ssm_state_indices", "num_accepted_tokens", "use_qk_l2norm_in_kernel"],
}


def runtime_signatures() -> list[str]:
    """The recurrence kernels the layer module actually holds (after import) take what the
    wrappers read."""
    mod = importlib.import_module(QWEN_GDN_MODULE)
    failures = []
    for name, params in WRAPPED_PARAMS.items():
        fn = getattr(mod, name, None)
        fn = getattr(fn, "__wrapped__", fn)
        if fn is None:
            failures.append(f"{name} missing from {mod.__name__}")
            continue
        got = list(inspect.signature(fn).parameters)
        if not all(p in got for p in params):
            failures.append(f"{name} parameters {got}, expected {params}")
    return failures


_undo: list = []  # callables that revert one change each, newest last


def install(platform: str) -> list[str]:
    """Make every change of this platform's points; returns what was patched (status())."""
    from vllm.model_executor.custom_op import op_registry_oot

    from . import model_hooks

    patched = []
    for point in points_for(platform):
        if point.kind == "model_class":
            _undo.append(model_hooks.remove_all)
            continue
        module = importlib.import_module(point.module)
        native = getattr(module, point.attribute, None)
        if native is None or (point.kind == "wrap" and not callable(native)):
            if point.required:  # the probes passed, so this is a vLLM that changed under us
                raise RuntimeError(f"{point.name} is missing although its probes passed")
            continue
        replacement = _resolve(point.replacement)
        if point.kind == "register_oot":
            replacement._replayssm_patch = True
            native.register_oot(replacement)
            _undo.append(lambda name=point.attribute: op_registry_oot.pop(name, None))
            patched.append(f"{point.attribute} -> {point.replacement.replace(':', '.')} (register_oot)")
        else:
            setattr(module, point.attribute, replacement(native))
            _undo.append(lambda m=module, a=point.attribute, n=native: setattr(m, a, n))
            patched.append(point.name)
    return patched


def revert() -> None:
    while _undo:
        _undo.pop()()
