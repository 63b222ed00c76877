"""Patch point: the served model class's page-size hooks, so that vLLM sizes the hybrid page
with the ring included (installed with the first ring layer: the class is known only then).

vLLM fixes the hybrid page size from the model class (`Platform._align_hybrid_block_size`,
in the worker after the model is built), independently of the layers' cache specs. If the
two disagree, `MambaSpec.page_size_bytes` asserts. So for the model class being served we
add the same ring tensors there:

* vLLM >= 0.31 prefers `get_mamba_specs_from_config` when a class has it: we give the class
  one (or extend Qwen4Exp's own GDN spec) and leave `get_mamba_state_dtype_from_config`
  alone, because the CPU platform requires that tuple to have exactly two entries; from 0.34
  the spec we give carries the state alignment vLLM would have sized the page with;
* older vLLM reads the shape and dtype hooks: we extend both.
"""

from __future__ import annotations

import inspect
import re
import sys

from .. import versions

_MARK = "_replayssm_page_hook"


def _model_class(config):
    """The model class vLLM serves for `config` (a VllmConfig or its ModelConfig)."""
    from vllm.model_executor.models.registry import ModelRegistry

    mc = getattr(config, "model_config", config)
    cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    return cls


def served_class(config):
    """The model class vLLM serves for `config` (for the other class hooks: align_copy_funcs)."""
    return _model_class(config)


def builds_qwen_gdn_layers(config) -> tuple[bool, str]:
    """Whether the served model class (of `config`, a VllmConfig or its ModelConfig) builds vLLM's `QwenGatedDeltaNetAttention` (the class the
    patch replaces, by name) somewhere below it: follows the vLLM classes each class's source
    names, starting from the model class and its bases. Olmo, Kimi and other GDN layers are
    their own classes and stay native."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention as target

    try:
        cls = _model_class(config)
    except Exception as e:
        return False, f"cannot resolve the model class: {e}"
    seen, todo = set(), [cls]
    while todo:
        for klass in todo.pop().__mro__:
            if klass in seen or not klass.__module__.startswith("vllm."):
                continue
            seen.add(klass)
            try:
                source = inspect.getsource(klass)
            except (OSError, TypeError):
                continue
            module = sys.modules.get(klass.__module__)
            for name in set(re.findall(r"\b[A-Za-z_]\w*\b", source)):
                obj = getattr(module, name, None)
                if obj is target:
                    return True, ""
                if isinstance(obj, type) and obj not in seen and obj.__module__.startswith("vllm."):
                    todo.append(obj)
    return False, (f"{cls.__name__} builds no {target.__name__} layer (its GDN layers, if any, are another "
                   "class, which the patch leaves native)")


def _set(cls, name, value, state):
    """Set a class attribute, with its undo in `state.undo` (and its name in state.patched)."""
    previous = cls.__dict__.get(name)

    def undo():
        if previous is None:
            if name in cls.__dict__:
                delattr(cls, name)
        else:
            setattr(cls, name, previous)

    state.undo.append(undo)
    setattr(cls, name, value)
    if name != _MARK:
        state.patched.append(f"{cls.__module__}.{cls.__qualname__}.{name} (page-size hook)")


def _alignment(vllm_config) -> dict:
    """The state alignment vLLM sizes the page of a class without `get_mamba_specs_from_config`
    with (vLLM >= 0.34: `mamba_state_alignment`, as `Platform._align_hybrid_block_size` passes
    it; older MambaSpecs pack states unaligned and take no such argument). A GDN layer packs its
    states, the ring's included (gdn_layer), at its own state_alignment: the class default 1,
    never more than this, so the page sized here holds everything it binds."""
    if not versions.capabilities().state_alignment:
        return {}
    from vllm.model_executor.layers.mamba.mamba_utils import mamba_state_alignment

    return {"state_alignment": mamba_state_alignment(vllm_config)}


def _is_gdn_state(spec, gdn_state_shape) -> bool:
    shapes = tuple(tuple(x) for x in spec.shapes)
    return len(shapes) == 2 and shapes[1] == tuple(gdn_state_shape)


def ensure(vllm_config, ring_shapes_for, state) -> tuple[bool, str]:
    """Install the hooks on the served model class (their undo goes to `state.undo`);
    `ring_shapes_for(vllm_config)` returns (shapes, dtypes) to append and the GDN SSM state shape
    they go with, or None when the ring is off for that config."""
    try:
        cls = _model_class(vllm_config)
    except Exception as e:  # registry API differences, import failures
        return False, f"cannot resolve the model class to size the cache page: {e}"
    if cls.__dict__.get(_MARK):
        return True, ""
    from vllm.v1.kv_cache_interface import MambaSpec

    if hasattr(cls, "get_mamba_specs_from_config"):
        native_specs = cls.get_mamba_specs_from_config  # bound classmethod

        def get_mamba_specs_from_config(klass, vllm_config):
            specs = list(native_specs(vllm_config))
            extra = ring_shapes_for(vllm_config)
            if extra is None:
                return specs
            from dataclasses import replace

            # the GDN spec is told by what it holds (conv state + an SSM state of the GDN
            # shape), not by its mamba_type: Qwen4Exp builds it without one (MAMBA2 by default)
            return [replace(s, shapes=tuple(s.shapes) + extra[0], dtypes=tuple(s.dtypes) + extra[1])
                    if _is_gdn_state(s, extra[2]) else s for s in specs]

        _set(cls, "get_mamba_specs_from_config", classmethod(get_mamba_specs_from_config), state)
    elif versions.capabilities().platform_prefers_specs:
        def get_mamba_specs_from_config(klass, vllm_config):
            shapes = tuple(klass.get_mamba_state_shape_from_config(vllm_config))
            dtypes = tuple(klass.get_mamba_state_dtype_from_config(vllm_config))
            extra = ring_shapes_for(vllm_config)
            if extra is not None:
                shapes, dtypes = shapes + extra[0], dtypes + extra[1]
            return [MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1, **_alignment(vllm_config))]

        _set(cls, "get_mamba_specs_from_config", classmethod(get_mamba_specs_from_config), state)
    else:
        native_shape = cls.get_mamba_state_shape_from_config
        native_dtype = cls.get_mamba_state_dtype_from_config

        def get_mamba_state_shape_from_config(klass, vllm_config):
            extra = ring_shapes_for(vllm_config)
            base = tuple(native_shape(vllm_config))
            return base if extra is None else base + extra[0]

        def get_mamba_state_dtype_from_config(klass, vllm_config):
            extra = ring_shapes_for(vllm_config)
            base = tuple(native_dtype(vllm_config))
            return base if extra is None else base + extra[1]

        _set(cls, "get_mamba_state_shape_from_config", classmethod(get_mamba_state_shape_from_config), state)
        _set(cls, "get_mamba_state_dtype_from_config", classmethod(get_mamba_state_dtype_from_config), state)
    _set(cls, _MARK, True, state)
    return True, ""
