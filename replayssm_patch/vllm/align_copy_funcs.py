"""Patch point: the served model class's `get_mamba_state_copy_funcs`, with MTP in align mode:
GDN states are copied by vLLM's conv copy only (installed with the first ring layer, when the plan
serves MTP under prefix caching).

vLLM's align copies move a request's conv and SSM states between cache blocks, the SSM state as
bytes taken from the block of the accepted speculative column (one of 1+T slots). With one slot
per request that column does not exist, and the bytes of a checkpoint are not the state its ring
stands for. vLLM copies the states its copy functions list, in order, and accepts a prefix of a
layer's states (`validate_mamba_state_copy_funcs`): listing the conv copy alone leaves the
conv state to vLLM, and the SSM state to the ring's moves (vllm.align_moves).
"""

from __future__ import annotations

_MARK = "_replayssm_copy_funcs_hook"


def conv_only(funcs: tuple) -> tuple:
    """The GDN copy functions reduced to the conv copy (vLLM lists conv first, then temporal)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec

    if not funcs or funcs[0] is not get_conv_copy_spec:
        raise RuntimeError(f"GDN ring: unexpected GDN state copy functions {funcs} (conv copy first expected)")
    return tuple(funcs[:1])


def ensure(cls, state) -> tuple[bool, str]:
    """Hook `cls` (the served model class); its undo goes to `state.undo`."""
    if cls.__dict__.get(_MARK):
        return True, ""
    native = getattr(cls, "get_mamba_state_copy_funcs", None)
    if native is None:
        return False, f"{cls.__name__} has no get_mamba_state_copy_funcs (the align copies cannot leave the ring's state alone)"
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    def get_mamba_state_copy_funcs(klass, mamba_types):
        funcs = dict(native(mamba_types))
        gdn = MambaAttentionBackendEnum.GDN_ATTN
        if gdn in funcs:
            funcs[gdn] = conv_only(tuple(funcs[gdn]))
        return funcs

    previous = cls.__dict__.get("get_mamba_state_copy_funcs")

    def undo():
        if previous is not None:
            setattr(cls, "get_mamba_state_copy_funcs", previous)
        elif "get_mamba_state_copy_funcs" in cls.__dict__:
            delattr(cls, "get_mamba_state_copy_funcs")
        if _MARK in cls.__dict__:
            delattr(cls, _MARK)

    state.undo.append(undo)
    cls.get_mamba_state_copy_funcs = classmethod(get_mamba_state_copy_funcs)
    setattr(cls, _MARK, True)
    state.patched.append(f"{cls.__module__}.{cls.__qualname__}.get_mamba_state_copy_funcs (align copies: conv only)")
    return True, ""
