"""Argument checks shared by the ring kernels' launchers (torch only).

Every check raises ValueError naming the offending argument and what is accepted, before any
kernel touches memory: a bad call never writes into a running engine's cache.
"""

from __future__ import annotations

import torch

RING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_device(dev: torch.device, **tensors) -> None:
    """Every given tensor (None is skipped) lives on `dev`."""
    for name, t in tensors.items():
        if t is not None and t.device != dev:
            raise ValueError(f"{name} must be on {dev} (got {t.device})")


def rows_tensor(t: torch.Tensor | None, n: int, name: str, dev: torch.device):
    """An optional per-row integer tensor (1-D, int32 or int64, at least `n` entries, on `dev`):
    (t, its stride), or (None, 0) when not given."""
    if t is None:
        return None, 0
    if t.ndim != 1 or t.shape[0] < n:
        raise ValueError(f"{name} must be 1-D with at least {n} entries (got {tuple(t.shape)})")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64 (got {t.dtype})")
    check_device(dev, **{name: t})
    return t, t.stride(0)


def slot_stride(t: torch.Tensor, name: str) -> int:
    """Stride of the slot dim; the dims after it must be contiguous (a page view is fine)."""
    shape, stride = t.shape, t.stride()
    acc = 1  # the stride a contiguous layout gives dim i (size-1 dims may have any)
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] > 1 and stride[i] != acc:
            raise ValueError(f"{name} must be contiguous after its slot dim (strides {stride})")
        acc *= shape[i]
    return stride[0]


# Accepted layouts -> ring_geometry's answer. Its checks and answer depend only on each
# tensor's shape, strides, dtype and device, which cost a quarter of the checks to read; a
# layer passes the same ring every call (the launchers' host time is paid per layer and step).
_GEOMETRY: dict = {}
_GEOMETRY_MAX = 256


def ring_geometry(state, ring_d, ring_k, ring_g, cursor, max_len: int):
    """Check the checkpoint + ring tensors; return (H, HV, K, V, L, slot strides).

    state [slots, HV, V, K], ring_d [slots, HV, L, V], ring_k [slots, H, L, K], ring_g
    [slots, HV, L] float32, cursor [slots] int32 contiguous; 1 <= L <= max_len.
    """
    layout = (max_len,) + tuple((t.shape, t.stride(), t.dtype, t.device)
                                for t in (state, ring_d, ring_k, ring_g, cursor))
    geometry = _GEOMETRY.get(layout)
    if geometry is None:
        geometry = _check_ring_geometry(state, ring_d, ring_k, ring_g, cursor, max_len)
        if len(_GEOMETRY) >= _GEOMETRY_MAX:
            _GEOMETRY.clear()
        _GEOMETRY[layout] = geometry
    return geometry


def _check_ring_geometry(state, ring_d, ring_k, ring_g, cursor, max_len: int):
    if state.ndim != 4:
        raise ValueError(f"state must be [slots, HV, V, K] (got {tuple(state.shape)})")
    slots, HV, V, K = state.shape
    if ring_g.ndim != 3:
        raise ValueError(f"ring_g must be [slots, HV, L] (got {tuple(ring_g.shape)})")
    L = ring_g.shape[-1]
    if tuple(ring_g.shape) != (slots, HV, L):
        raise ValueError(f"ring_g must have shape {(slots, HV, L)} (got {tuple(ring_g.shape)})")
    if tuple(ring_d.shape) != (slots, HV, L, V):
        raise ValueError(f"ring_d must have shape {(slots, HV, L, V)} (got {tuple(ring_d.shape)})")
    if ring_k.ndim != 4 or ring_k.shape[0] != slots or tuple(ring_k.shape[2:]) != (L, K):
        raise ValueError(f"ring_k must have shape ({slots}, H, {L}, {K}) (got {tuple(ring_k.shape)})")
    H = ring_k.shape[1]
    if H <= 0 or HV % H:
        raise ValueError(f"state's value heads HV={HV} must be a multiple of ring_k's key heads H={H}")
    if tuple(cursor.shape) != (slots,) or cursor.dtype != torch.int32 or cursor.stride(0) != 1:
        raise ValueError(f"cursor must be contiguous int32 of shape ({slots},) "
                         f"(got {cursor.dtype} {tuple(cursor.shape)})")
    if ring_g.dtype != torch.float32:
        raise ValueError(f"ring_g must be float32 (got {ring_g.dtype})")
    for name, t in (("state", state), ("ring_d", ring_d), ("ring_k", ring_k)):
        if t.dtype not in RING_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16 (got {t.dtype})")
    if not 1 <= L <= max_len:
        raise ValueError(f"ring length L={L} (ring_g's last dim) must be in [1, {max_len}]")
    if K < 16 or V < 16:
        raise ValueError(f"head dims must be >= 16 (got K={K}, V={V})")
    check_device(state.device, ring_d=ring_d, ring_k=ring_k, ring_g=ring_g, cursor=cursor)
    strides = tuple(slot_stride(t, name) for name, t in
                    (("state", state), ("ring_d", ring_d), ("ring_k", ring_k), ("ring_g", ring_g)))
    return H, HV, K, V, L, strides


def check_packed_inputs(mixed_qkv, a, b, A_log, dt_bias, H: int, HV: int, K: int, V: int) -> int:
    """vLLM's packed decode inputs: mixed_qkv [tokens, 2*H*K + HV*V], a/b [tokens, HV] (last dim
    contiguous), A_log/dt_bias contiguous with HV elements. Returns the token count."""
    if mixed_qkv.ndim != 2 or mixed_qkv.stride(-1) != 1:
        raise ValueError("mixed_qkv must be 2-D [tokens, 2*H*K + HV*V], contiguous in its last dim")
    n = mixed_qkv.shape[0]
    if mixed_qkv.shape[1] != 2 * H * K + HV * V:
        raise ValueError(
            f"mixed_qkv last dim {mixed_qkv.shape[1]} != 2*H*K + HV*V = {2 * H * K + HV * V} "
            f"(H={H} from ring_k, HV={HV}, K={K}, V={V})"
        )
    for name, t in (("a", a), ("b", b)):
        if t.ndim != 2 or t.shape[0] != n or t.shape[1] != HV or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [tokens, HV] = [{n}, {HV}], contiguous in its last dim "
                             f"(got {tuple(t.shape)})")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.numel() != HV or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous with HV={HV} elements (got {tuple(t.shape)})")
    return n
