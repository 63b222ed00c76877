"""Every change the package makes to vLLM, indexed: `POINTS`.

One entry per patch point, one file per point in this package (its replacement and nothing else).
Each entry says what it changes, why, how, the upstream work that would make it unnecessary, when
it can go, when it applies, and the source probes that must pass before anything changes.
`install` / `revert`, the probes (`run_probes`) and status()["patched"] come from this table.

When a point applies:
  "process start"    installed by `install()` (patch() or the plugin, in every vLLM process);
                     an `unconditional` one by `install_unconditional()` (the plugin, in every
                     process, whatever the config: its replacement is inert until asked for);
  "first ring layer" installed when vLLM builds the first GDN layer the plan puts on the ring
                     (the served model class is known only then);
  "ring layer"       applied to each GDN layer the plan puts on the ring, as it is built;
  "ring backend"     set by the ring's metadata builder on itself (a vLLM attribute it opts into).

A point with `vllm_versions` (a version specifier) exists only in those vLLM releases: the CPU
build's kernel wrappers moved from vllm._custom_ops to vllm._cpu_ops in 0.34, so those points are
declared once per module, and only the installed release's are probed and installed.

Kinds: "register_oot" (a layer class registered as vLLM's out-of-tree replacement), "wrap"
(module.attribute = make_wrapper(native)), "class hooks" (methods of the served model class),
"attribute" (a vLLM attribute set on our own objects), "call" (vLLM's calls re-made by our code),
"environment" (a variable set for a library the ring calls).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .. import versions
from ..versions import (
    ARG_UTILS,
    CPU_GDN,
    CUSTOM_OP,
    GDN_BUILDER,
    KV_IFACE,
    MAMBA_ABSTRACT,
    QWEN_GDN,
    Probe,
    advances_offset_by,
    assigns_attribute,
    calls_in_order,
    calls_with_keywords,
    dataclass_fields,
    has_method,
    imports_module_as,
    imports_name,
    installed_source,
    method_calls,
    registers_op,
)

WORKER_BASE = "vllm/v1/worker/worker_base.py"
CONFIG_VLLM = "vllm/config/vllm.py"
CONFIG_COMPILATION = "vllm/config/compilation.py"
METRICS_LOGGERS = "vllm/v1/metrics/loggers.py"
QWEN_GDN_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
CPU_GDN_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
LAYER_CLASS = "QwenGatedDeltaNetAttention"
CPU_UPDATE_PARAMS = ["A_log", "dt_bias", "q", "k", "v", "a", "b", "initial_state_source",
                     "initial_state_indices", "cu_seqlens", "use_qk_l2norm_in_kernel"]
_LAYER = "replayssm_patch.vllm.gdn_layer:ReplayQwenGDN"
FUSED_DECODE_FLAGS = ("enable_fused_gdn_spec_decode", "enable_fused_gdn_decode")  # vLLM >= 0.32, before


@dataclass(frozen=True)
class PatchPoint:
    kind: str
    module: str  # where the changed attribute lives (vLLM's module, or the library's)
    attribute: str
    replacement: str  # "module:name" in this package
    what: str
    why: str
    how: str
    upstream: str  # the upstream work that would make the point unnecessary
    remove_when: str
    applies: str = "process start"
    platform: str = "any"  # "any" | "cpu" | "cuda"
    required: bool = True  # False: skipped where this vLLM build lacks the attribute
    probes: tuple[Probe, ...] = ()
    # True: installed by install_unconditional() in every process, also with the ring off (its
    # replacement does nothing until the user asks for it); where its probes fail it is not
    # installed, and the ring's own points are not held back by it
    unconditional: bool = False
    vllm_versions: str = ""  # the vLLM releases the point exists in (a version specifier; "": all supported)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"

    def exists_in(self, version: Version) -> bool:
        return Version(version.base_version) in SpecifierSet(self.vllm_versions)


_SEED = "vLLM PR 65657 (FlashInfer GDN ReplaySSM) and its successors: GDN ReplaySSM inside vLLM"

_PREFILL_MEMORY_UPSTREAM = "vllm-project/vllm#54775 (the GDN prefill's workspace in the memory profile)"
MAMBA_UTILS = "vllm/v1/worker/mamba_utils.py"
_ALIGN_CTX = "MambaSpecDecodeGPUContext"
_ALIGN_UPSTREAM = ("a hook in vLLM's align-mode state moves for states a layer keeps itself (vLLM 0.34 has one for "
                   "its own Mamba2 ReplaySSM only: replayssm_utils), or GDN ReplaySSM inside vLLM")


def _align_point(method: str, params: list[str], what: str, how: str, releases: str) -> PatchPoint:
    """A method of vLLM's align-mode move context (MTP with prefix caching), wrapped."""
    return PatchPoint(
        "wrap", "vllm.v1.worker.mamba_utils", f"{_ALIGN_CTX}.{method}",
        f"replayssm_patch.vllm.align_moves:{_ALIGN_WRAPPERS[method]}", vllm_versions=releases,
        what=what,
        why="with MTP under prefix caching (align mode) vLLM moves states between cache blocks as bytes, taking "
            "the SSM state from speculative columns a one-slot ring does not have; the ring moves its own state",
        how=how, upstream=_ALIGN_UPSTREAM, remove_when="vLLM lets a layer move its own state in align mode",
        probes=(Probe(f"{_ALIGN_CTX}.{method}", MAMBA_UTILS, has_method(_ALIGN_CTX, method, params, exact=True)),))


_ALIGN_WRAPPERS = {
    "initialize_from_forward_context": "make_initialize_wrapper",
    "run_fused_precopy": "make_precopy_wrapper",
    "run_fused_postprocess": "make_postprocess_wrapper",
    "run_fused_postprocess_align": "make_postprocess_align_wrapper",
}


def _cpu_kernel_points(module: str, releases: str) -> tuple[PatchPoint, ...]:
    """The CPU build's two GDN recurrence kernels, as `module` holds them in `releases`; vLLM's CPU
    GDN path calls them as attributes of that module (`ops.<name>`), resolved at each call."""
    path = versions.module_source_path(module)
    return (
        PatchPoint(
            "wrap", module, "fused_sigmoid_gating_delta_rule_update_cpu",
            "replayssm_patch.vllm.cpu_update:make_wrapper", platform="cpu", vllm_versions=releases,
            what="vLLM's CPU decode recurrence",
            why="the call the ring's decode replaces on CPU",
            how="the ring's step, taken by this very kernel from each row's replayed state (ring.cpu)",
            upstream=_SEED, remove_when="as the CPU core",
            probes=(Probe("CPU decode kernel", path, has_method(None, "fused_sigmoid_gating_delta_rule_update_cpu",
                                                                CPU_UPDATE_PARAMS)),
                    Probe("CPU GDN kernels' module", CPU_GDN, imports_module_as(module, "ops")))),
        PatchPoint(
            "wrap", module, "fused_sigmoid_gating_delta_rule_update_spec_cpu",
            "replayssm_patch.vllm.cpu_spec_update:make_wrapper", platform="cpu", required=False,
            vllm_versions=releases,
            what="vLLM's CPU MTP recurrence (1+T state slots per request)",
            why="the call the ring's verify replaces on CPU",
            how="the ring's verify: commit the previous window, verify, keep the new window pending",
            upstream=_SEED, remove_when="as the CPU core"),
    )


POINTS = (
    PatchPoint(
        "register_oot", QWEN_GDN_MODULE, LAYER_CLASS, _LAYER,
        what="every Qwen GDN layer vLLM builds is ReplayQwenGDN (Olmo and Kimi GDN layers are other classes)",
        why="the ring needs its tensors in the layer's cache page, its plan in the cache spec and its "
            "kernels in the decode path",
        how="a subclass: get_kv_cache_spec / bind_kv_cache add the ring, get_attn_backend returns the ring "
            "backend, _forward_core runs vLLM's own core inside a ring call",
        upstream=_SEED, remove_when="vLLM serves GDN ReplaySSM itself",
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
            # the ring's tensors are packed after vLLM's states as vLLM packs those (gdn_backend.state_offsets)
            Probe("MambaBase.bind_kv_cache packing", MAMBA_ABSTRACT,
                  advances_offset_by("MambaBase", "bind_kv_cache", "nbytes", "round_up(nbytes, self.state_alignment)")),
            Probe("MambaBase.get_kv_cache_spec", MAMBA_ABSTRACT, has_method("MambaBase", "get_kv_cache_spec")),
            Probe("MambaSpec fields", KV_IFACE, dataclass_fields("MambaSpec", ["shapes", "dtypes", "page_size_padded"])),
            Probe("PluggableLayer.register_oot", CUSTOM_OP, has_method("PluggableLayer", "register_oot")),
        )),
    PatchPoint(
        "wrap", QWEN_GDN_MODULE, "fused_recurrent_gated_delta_rule_packed_decode",
        "replayssm_patch.vllm.packed_decode:make_wrapper",
        what="vLLM's decode recurrence of pure decode batches (CUDA)",
        why="the call the ring's decode replaces",
        how="passes through unless a ring call is active for the state it was given; then the ring's decode",
        upstream=_SEED, remove_when="as the layer class",
        probes=(Probe("packed decode kernel import", QWEN_GDN,
                      imports_name("fused_recurrent_gated_delta_rule_packed_decode")),)),
    PatchPoint(
        "wrap", QWEN_GDN_MODULE, "fused_sigmoid_gating_delta_rule_update",
        "replayssm_patch.vllm.sigmoid_update:make_wrapper",
        what="vLLM's recurrence of mixed batches' decode rows and, with num_accepted_tokens, the MTP verify (CUDA)",
        why="the calls the ring's decode and verify replace",
        how="decode rows to the ring's decode, verify calls to its verify; anything else passes through after "
            "its rows' rings are flushed",
        upstream=_SEED, remove_when="as the layer class",
        probes=(Probe("sigmoid-gating update import", QWEN_GDN,
                      imports_name("fused_sigmoid_gating_delta_rule_update")),)),
    PatchPoint(
        "call", QWEN_GDN_MODULE, f"{LAYER_CLASS}._forward_core (MTP verify-only steps)",
        "replayssm_patch.vllm.spec_verify_step:verify_step", platform="cuda",
        what="a step whose rows are all MTP verify rows makes vLLM's conv update and the ring's verify itself",
        why="vLLM's unfused Python around the two calls (split, cat, binding, copy) cost the host more than "
            "the GPU work it wraps at large batches",
        how="the same causal_conv1d_update call, with the same arguments, as vLLM's _forward_core makes for "
            "such a step, then the ring's verify on its output",
        upstream=_SEED, remove_when="as the layer class", applies="ring layer",
        probes=(Probe("spec conv update call", QWEN_GDN, calls_with_keywords(
            "causal_conv1d_update", ["conv_state_indices", "num_accepted_tokens", "query_start_loc",
                                     "max_query_len", "validate_data"])),)),
    PatchPoint(
        "call", QWEN_GDN_MODULE, f"{LAYER_CLASS}._warmup_prefill_kernels (memory profile)",
        "replayssm_patch.vllm.prefill_profile:prefill_step", platform="cuda",
        what="a ring layer's profile forward also runs one whole GDN prefill step of the profile's tokens",
        why="vLLM's memory profile skips the GDN core, so a prefill step's temporaries were memory the engine "
            "held beyond the budget it was given",
        how="after vLLM's kernel warmup, once, on CUDA: the allocations of vLLM's prefill step over as many "
            "sequences as max_num_seqs allows, the scan through the layer's own prefill op",
        upstream=_PREFILL_MEMORY_UPSTREAM,
        remove_when="vLLM's memory profile counts a GDN prefill step", applies="ring layer",
        probes=(Probe("layer _warmup_prefill_kernels", QWEN_GDN, has_method(
                    LAYER_CLASS, "_warmup_prefill_kernels", ["self", "qkv_or_qkvz", "v_dim"], exact=True)),
                Probe("layer prefill op", QWEN_GDN, has_method(
                    "ChunkGatedDeltaRule", "forward_native",
                    ["q", "k", "v", "g", "beta", "initial_state", "output_final_state", "cu_seqlens",
                     "use_qk_l2norm_in_kernel"])))),
    PatchPoint(
        "wrap", QWEN_GDN_MODULE, f"{LAYER_CLASS}.chunk_gated_delta_rule (prefill op)",
        "replayssm_patch.vllm.prefill_groups:GroupedPrefillOp", platform="cuda", vllm_versions=">=0.33",
        what="a ring layer's prefill op runs a step's scan per group of chunks (long sequences cut at chunk "
             "boundaries, their state passed on in fp32)",
        why="one call over a whole step holds temporaries for all its tokens and final states for all its "
            "sequences; the ring engine's memory profile holds that step back from the KV cache",
        how="the layer's op wrapped: groups drawn by the ring's builder beside vLLM's chunk metadata "
            "(_build_chunk_metadata, with its chunk metadata per group), each group gathering its "
            "sequences' states from the pool and scattering its final states back as vLLM does, vLLM's own gather "
            "and scatter around the op left one sequence (the builder's prefill_state_indices); Triton prefill op only",
        upstream=_PREFILL_MEMORY_UPSTREAM,
        remove_when="vLLM bounds its GDN prefill's memory per step", applies="ring layer",
        probes=(Probe("builder chunk metadata", GDN_BUILDER, has_method(
                    "GDNAttentionMetadataBuilder", "_build_chunk_metadata",
                    ["self", "prefill_query_start_loc", "prefill_query_start_loc_cpu", "device"], exact=True)),
                Probe("layer prefill call", QWEN_GDN, calls_with_keywords(
                    "chunk_gated_delta_rule", ["initial_state", "output_final_state", "cu_seqlens",
                                               "chunk_indices", "chunk_offsets"])))),
    PatchPoint(
        "wrap", QWEN_GDN_MODULE, f"{LAYER_CLASS}.chunk_gated_delta_rule (FlashInfer prefill op)",
        "replayssm_patch.vllm.flashinfer_pool_prefill:PoolPrefillOp", platform="cuda", vllm_versions="~=0.33.0",
        what="a ring layer's FlashInfer prefill op reads and writes the step's states in the state pool by row",
        why="vLLM's layer gathers every prefill sequence's state and FlashInfer returns their final states in a "
            "new fp32 tensor; the ring engine's memory profile holds that step back from the KV cache",
        how="the layer's op wrapped: FlashInfer's chunk_gated_delta_rule with state_indices and output_state on the "
            "pool, the rows of sequences without a state zeroed first, the inputs prepared as vLLM's "
            "fi_chunk_gated_delta_rule prepares them, vLLM's own gather and scatter left one sequence; only in "
            "releases where its GPU test passed (versions.FLASHINFER_POOL_PREFILL_VALIDATED)",
        upstream=_PREFILL_MEMORY_UPSTREAM,
        remove_when="vLLM calls FlashInfer's GDN prefill on its state pool", applies="ring layer",
        probes=(Probe("FlashInfer prefill wrapper", QWEN_GDN, has_method(
                    None, "fi_chunk_gated_delta_rule",
                    ["q", "k", "v", "g", "beta", "initial_state", "output_final_state", "cu_seqlens"])),
                Probe("layer prefill call", QWEN_GDN, calls_with_keywords(
                    "chunk_gated_delta_rule", ["initial_state", "output_final_state", "cu_seqlens"])))),
    PatchPoint(
        "attribute", QWEN_GDN_MODULE, f"{LAYER_CLASS}.enable_fused_gdn_spec_decode",
        "replayssm_patch.vllm.fused_decode_flags:disable",
        what="vLLM's fused MTP decode is off on MTP ring layers (enable_fused_gdn_decode before vLLM 0.32)",
        why="it reads and writes 1+T state slots per request itself; with one slot every verify must reach "
            "_forward_core",
        how="the layer's flag set to False when the plan serves MTP",
        upstream=_SEED, remove_when="as the layer class", applies="ring layer",
        probes=(Probe("fused MTP flag", QWEN_GDN, assigns_attribute(LAYER_CLASS, *FUSED_DECODE_FLAGS)),)),
    PatchPoint(
        "attribute", versions.GDN_BUILDER_MODULE, "GDNAttentionMetadataBuilder.supports_update_block_table",
        "replayssm_patch.vllm.metadata_reuse:opt_in", platform="cuda", required=False, vllm_versions=">=0.31",
        what="the ring's builder opts into vLLM's metadata reuse across GDN cache groups",
        why="vLLM turns it on for its own builder class only; without it every group rebuilds all metadata "
            "on the host every step",
        how="the builder sets supports_update_block_table and mamba_aligned_state_indices on itself, under "
            "vLLM's own conditions (no MTP: the commit slots need each step's accepted counts)",
        upstream="vLLM's reuse condition accepting subclasses", remove_when="vLLM accepts subclasses",
        applies="ring backend",
        probes=(Probe("builder update_block_table", GDN_BUILDER,
                      has_method("GDNAttentionMetadataBuilder", "update_block_table")),)),
    PatchPoint(
        "class hooks", "vllm.model_executor.models.<served model class>",
        "get_mamba_specs_from_config (vLLM >= 0.31) or get_mamba_state_{shape,dtype}_from_config",
        "replayssm_patch.vllm.model_class:ensure",
        what="the served model class sizes the hybrid page with the ring",
        why="vLLM sizes the page from the model class, apart from the layers' specs: both must include the "
            "ring or MambaSpec.page_size_bytes asserts",
        how="the class's hook appends the ring's shapes and dtypes to its GDN spec (found by its state shape)",
        upstream=_SEED, remove_when="as the layer class", applies="first ring layer"),
    PatchPoint(
        "class hooks", "vllm.model_executor.models.<served model class>", "get_mamba_state_copy_funcs",
        "replayssm_patch.vllm.align_copy_funcs:ensure",
        what="with MTP under prefix caching, vLLM's align copies list the GDN conv state only",
        why="vLLM's SSM copy reads a speculative column a one-slot ring does not have, and a checkpoint's bytes "
            "are not the state its ring stands for",
        how="the class's hook returns vLLM's GDN copy functions cut to their first (conv) one, a prefix vLLM "
            "accepts; the ring moves the SSM state (align_moves)",
        upstream=_ALIGN_UPSTREAM, remove_when="as align_moves", applies="first ring layer"),
    _align_point("initialize_from_forward_context",
                 ["self", "kv_cache_config", "forward_context", "mamba_state_copy_funcs", "block_tables",
                  "aligned_index_block_tables"],
                 what="vLLM's align move context also records the ring layers, block tables and copy lists",
                 how="after vLLM's own initialisation, ring.align.Moves kept on the context (none: MTP native)",
                 releases=">=0.32"),
    _align_point("run_fused_precopy",
                 ["self", "num_reqs", "state_idx_gpu", "src_col_gpu", "token_bias_gpu", "idx_mapping"],
                 what="before a step, a request whose live block changed gets the state its old block's ring "
                      "stands for, with an empty ring",
                 how="ring_publish (ring.align.migrate), then vLLM's copies (on CPU the same copies in torch: "
                     "vLLM's are Triton kernels)", releases=">=0.32"),
    _align_point("run_fused_postprocess",
                 ["self", "num_reqs", "num_accepted_tokens_gpu", "mamba_state_idx_gpu", "num_scheduled_tokens_gpu",
                  "num_computed_tokens_gpu", "num_draft_tokens_gpu"],
                 what="after sampling (V1 runner), the accepted entries are committed and the state at a block "
                      "boundary the accepted tokens reached is published into the block it completes",
                 how="ring_publish with the accepted counts (ring.align.publish) before vLLM's kernel rewrites "
                     "them, then vLLM's copies (torch on CPU)", releases=">=0.32,<0.34"),
    _align_point("run_fused_postprocess_align",
                 ["self", "num_reqs", "num_accepted_tokens_gpu", "state_idx_gpu", "new_num_computed_tokens_gpu",
                  "idx_mapping"],
                 what="as run_fused_postprocess, for the V2 runner", how="as run_fused_postprocess",
                 releases=">=0.32"),
    PatchPoint(
        "wrap", CPU_GDN_MODULE, "_cpu_gdn_attention_nonspec", "replayssm_patch.vllm.cpu_core:make_wrapper",
        platform="cpu",
        what="vLLM's CPU GDN core",
        why="the CPU build runs the GDN core here, not through _forward_core",
        how="the same ring bookkeeping as _forward_core (commit, flush prefill rows, reset after prefill)",
        upstream=_SEED, remove_when="vLLM's CPU path goes through _forward_core, or ships the ring",
        probes=(Probe("CPU GDN non-spec path", CPU_GDN,
                      has_method(None, "_cpu_gdn_attention_nonspec", ["layer", "attn_metadata_i"])),)),
    PatchPoint(
        "wrap", CPU_GDN_MODULE, "_cpu_gdn_attention_spec_aware", "replayssm_patch.vllm.cpu_core:make_wrapper",
        platform="cpu", required=False,
        what="vLLM's CPU GDN core with MTP (absent from older builds: MTP stays native there)",
        why="as the non-spec core", how="as the non-spec core; its kernels go through the wrappers below",
        upstream=_SEED, remove_when="as the CPU core"),
    *_cpu_kernel_points("vllm._custom_ops", f"<{versions.CPU_OPS_VERSION}"),
    *_cpu_kernel_points("vllm._cpu_ops", f">={versions.CPU_OPS_VERSION}"),
    PatchPoint(
        "attribute", "vllm.v1.worker.worker_base", "WorkerBase.replayssm_status",
        "replayssm_patch.vllm.worker_status:replayssm_status",
        what="vLLM's workers answer collective_rpc('replayssm_status') with their patch report",
        why="the layers and the ring's counters live where vLLM builds the model, by default another "
            "process: status(llm) asks the workers by a method name, which vLLM sends without pickling code",
        how="a method added to WorkerBase (vLLM's own methods untouched)",
        upstream="none: a plugin's own report", remove_when="vLLM offers plugins a status channel",
        probes=(Probe("worker base class", WORKER_BASE, has_method("WorkerBase", "__init__")),)),
    PatchPoint(
        "wrap", "vllm.v1.metrics.loggers", "PrometheusStatLogger.log_metrics_info",
        "replayssm_patch.vllm.metrics_info:make_wrapper",
        what="a server's /metrics shows the plan (replayssm_patch:plan_info) beside vLLM's cache_config_info",
        why="an operator looks at /metrics, where vLLM's own use_replayssm label is its Mamba2 option, not "
            "this package; the ring's decision was in the engine log alone",
        how="after vLLM records cache_config_info, the plan drawn from the same engine config is recorded as "
            "an info gauge (1, its labels the decision); vLLM's metrics untouched",
        upstream="none: a plugin's own metric", remove_when="vLLM lets plugins add metrics to its stat loggers",
        probes=(Probe("Prometheus cache_config_info", METRICS_LOGGERS,
                      has_method("PrometheusStatLogger", "log_metrics_info", ["self", "type", "config_obj"])),)),
    PatchPoint(
        "wrap", "vllm.engine.arg_utils", "EngineArgs.create_model_config",
        "replayssm_patch.vllm.replayssm_flag:make_wrapper", unconditional=True,
        what="vLLM's own --use-replayssm / LLM(use_replayssm=True) turns this package's ring on for model "
             "classes that build Qwen GDN layers, --replayssm-buffer-len giving the ring length",
        why="vLLM's flag is Mamba2 ReplaySSM: its validator refuses every class without SupportsReplaySSM (no "
            "Qwen class has it) and its machinery acts on every Mamba layer (no speculative state blocks, "
            "backend and model-runner constraints)",
        how="after vLLM's create_model_config, for such a class: the flag is taken off the EngineArgs before "
            "CacheConfig is built, the patch applies in this process and its config goes into the environment "
            "for vLLM's engine-core and worker processes; other classes pass through untouched",
        upstream="GDN ReplaySSM behind vLLM's own flag (the Qwen GDN classes declaring SupportsReplaySSM)",
        remove_when="vLLM serves --use-replayssm for the Qwen GDN classes itself",
        probes=(
            Probe("EngineArgs flag fields", ARG_UTILS, dataclass_fields("EngineArgs", ["use_replayssm",
                                                                                    "replayssm_buffer_len"])),
            Probe("EngineArgs.create_model_config", ARG_UTILS,
                  has_method("EngineArgs", "create_model_config", ["self"], exact=True)),
            Probe("ModelConfig before CacheConfig", ARG_UTILS, calls_in_order(
                "EngineArgs", "create_engine_config", "create_model_config", "CacheConfig", "use_replayssm")),
            Probe("plugins load in EngineArgs", ARG_UTILS, method_calls("EngineArgs", "__post_init__",
                                                                        "load_general_plugins")),
        )),
    PatchPoint(
        "wrap", "vllm.config.vllm", "VllmConfig._set_cudagraph_sizes", "replayssm_patch.vllm.graph_sizes:make_wrapper",
        platform="cuda",
        what="where MTP decodes through the ring and the user left the capture sizes unset, the uniform verify "
             "batches up to max_num_seqs requests (or about as many as fit the engine's memory) get CUDA graphs",
        why="vLLM captures up to a fixed token ceiling sized for the requests native holds; the ring holds "
            "several times more, whose verify steps then ran eagerly",
        how="after vLLM sets its sizes: the verify sizes n*(1+T) added to its list, then vLLM's own "
            "post_init_cudagraph_sizes again; from 0.34 (decode graphs by request count) vLLM resolves the "
            "sizes again with max_decode_cudagraph_capture_requests set; a user's sizes are left as they are",
        upstream=_SEED, remove_when="vLLM sizes its verify graphs for the requests its cache holds",
        probes=(
            Probe("VllmConfig._set_cudagraph_sizes", CONFIG_VLLM,
                  has_method("VllmConfig", "_set_cudagraph_sizes", ["self"], exact=True)),
            Probe("VllmConfig.uniform_decode_query_len", CONFIG_VLLM,
                  has_method("VllmConfig", "uniform_decode_query_len")),
            Probe("CompilationConfig capture sizes", CONFIG_COMPILATION,
                  dataclass_fields("CompilationConfig", ["cudagraph_capture_sizes", "max_cudagraph_capture_size"])),
            Probe("CompilationConfig.post_init_cudagraph_sizes", CONFIG_COMPILATION,
                  has_method("CompilationConfig", "post_init_cudagraph_sizes", ["self"], exact=True)),
        )),
    PatchPoint(
        "environment", "flashinfer.gdn_kernels", "SGLANG_GDN_WY_STRIDED_QKV",
        "replayssm_patch.ring.flashinfer:load_kernel", platform="cuda", required=False,
        what="FlashInfer's ReplaySSM MTP kernel reads block-strided pools (set only with mtp_kernel='flashinfer')",
        why="the ring's checkpoints and entries are views into vLLM's paged cache",
        how="the variable is set (unless already set) before FlashInfer's module loads",
        upstream="FlashInfer taking the pool's strides per call", remove_when="FlashInfer does",
        applies="ring layer"),
)


def points_for(platform: str, version: Version, unconditional: bool = False) -> tuple[PatchPoint, ...]:
    """The points of `platform` that exist in vLLM `version`: the ring's, or (`unconditional`) those
    installed whatever the config."""
    return tuple(p for p in POINTS if p.platform in ("any", platform) and p.exists_in(version)
                 and p.unconditional == unconditional)


def run_probes(read_source: Callable[[str], str | None] = installed_source, cpu: bool = False,
               version: Version | None = None, unconditional: bool = False) -> list[str]:
    """The failed probes of this platform's required points in vLLM `version` (default: the
    installed one; empty: all look as expected; a point that is not required applies only where its
    vLLM has it); `read_source(path)` gives a vLLM source file's text (the installed one, or a
    released wheel's). `unconditional`: the probes of the points install_unconditional() installs
    instead of the ring's."""
    version = versions.installed_base_version() if version is None else version
    if version is None:
        return ["vLLM's version is unknown"]
    trees: dict = {}
    return [f for point in points_for("cpu" if cpu else "cuda", version, unconditional) if point.required
            for f in _probe_failures(point, read_source, trees)]


def _probe_failures(point: PatchPoint, read_source, trees: dict) -> list[str]:
    failures = []
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
    """The recurrence kernels the layer module holds (after import) take what the wrappers read."""
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


def resolve(ref: str):
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def install(platform: str, state) -> list[str]:
    """Make the "process start" changes of this platform's points; returns their names and
    records how to undo each in `state.undo`."""
    from vllm.model_executor.custom_op import op_registry_oot

    patched = []
    for point in points_for(platform, versions.capabilities().version):
        if point.applies != "process start":
            continue
        module = importlib.import_module(point.module)
        owner_name, _, attr = point.attribute.rpartition(".")  # "Class.method" or a module's "name"
        owner = getattr(module, owner_name, None) if owner_name else module
        native = getattr(owner, attr, None) if point.kind != "attribute" else owner
        if native is None or (point.kind == "wrap" and not callable(native)):
            if point.required:  # the probes passed, so this is a vLLM that changed under us
                raise RuntimeError(f"{point.name} is missing although its probes passed")
            continue
        replacement = resolve(point.replacement)
        if point.kind == "attribute":  # a method of ours added to a vLLM class
            setattr(owner, attr, replacement)
            state.undo.append(lambda c=owner, a=attr: delattr(c, a))
            patched.append(point.name)
        elif point.kind == "register_oot":
            replacement._replayssm_patch = True
            native.register_oot(replacement)
            state.undo.append(lambda name=point.attribute: op_registry_oot.pop(name, None))
            patched.append(f"{point.attribute} -> {point.replacement.replace(':', '.')} (register_oot)")
        else:  # wrap a module's function or a class's method
            setattr(owner, attr, replacement(native))
            state.undo.append(lambda o=owner, a=attr, n=native: setattr(o, a, n))
            patched.append(point.name)
    return patched


_HOOK_MARK = "_replayssm_patch_hook"  # set on what install_unconditional() installed


def _method_owner(point: PatchPoint):
    cls_name, _, method = point.attribute.partition(".")
    return getattr(importlib.import_module(point.module), cls_name), method


def install_unconditional(read_source: Callable[[str], str | None] = installed_source) -> list[str]:
    """Install the unconditional points (class methods wrapped) whose probes pass; idempotent. A
    vLLM without what a point changes (say, without the --use-replayssm flag) fails its probes:
    nothing to install there, and no error. Returns the names of the points installed now or
    before. Kept apart from `state.undo`: revert() and unpatch() leave them (they are inert)."""
    installed, trees = [], {}
    for point in POINTS:
        if not point.unconditional:
            continue
        owner, method = _method_owner(point)
        current = getattr(owner, method, None)
        if not getattr(current, _HOOK_MARK, False):
            if current is None or _probe_failures(point, read_source, trees):
                continue
            wrapper = resolve(point.replacement)(current)
            setattr(wrapper, _HOOK_MARK, True)
            setattr(owner, method, wrapper)
        installed.append(point.name)
    return installed


def unconditional_installed() -> list[str]:
    """The unconditional points installed in this process (status()["hooks"])."""
    out = []
    for point in POINTS:
        if point.unconditional and point.module in sys.modules:
            owner, method = _method_owner(point)
            if getattr(getattr(owner, method, None), _HOOK_MARK, False):
                out.append(point.name)
    return out


def uninstall_unconditional() -> None:
    """Put back vLLM's methods (tests)."""
    for point in POINTS:
        if point.unconditional:
            owner, method = _method_owner(point)
            current = getattr(owner, method, None)
            if getattr(current, _HOOK_MARK, False):
                setattr(owner, method, current.__wrapped__)


def revert(state) -> None:
    while state.undo:
        state.undo.pop()()
