"""ReplaySSM speculative verify for Gated DeltaNet, with a delayed commit: `ring_verify`
(imports torch and triton only).

Semantics: exactly those of `verify_reference.ring_spec_verify_reference` (the ring layout:
ring_state_reference; the cursor word: cursor). The commit alone is `commit.ring_commit`.

One launch = one speculative step. Row i owns the tokens cu_seqlens[i]:cu_seqlens[i+1] (the
bonus token and the drafts; any count up to `max_tokens`, zero allowed). Per row:

  1. delayed commit: the slot's previous window (pending p > 0) gets min(num_accepted[i], p)
     of its entries committed (n += ...), the rest is dropped;
  2. if the new window does not fit (n + T_i > L) the committed entries are flushed into the
     checkpoint (S_c = replayed state, n = 0);
  3. every token's output is computed as if the row's earlier tokens were accepted, and the
     tokens' replay entries (d, k, G) are written at ring positions n..n+T_i-1 as the slot's
     new pending window.

Three launches on one stream:

  1. prep, per (row, key head): what the key head's value heads and value blocks share per
     token -- q_t and k_t normalised in fp32 (`qk`, [tokens, H, 2, K]), k_t . q_t and the
     gates alpha_t, beta_t of each value head of the group (`gates`, [rows, H, WP, row width]).
  2. main, per (row, value head, block of BV value rows) -- batch x HV x V/BV programs of one
     warp, as vLLM's native spec kernel: rows of the state are independent given those
     numbers, so each program replays the slot's committed entries into its checkpoint tile
     once (rank-1 updates; on a flush the result is also stored as the new checkpoint), runs
     the window's tokens through the plain recurrence on that tile in registers, and writes
     its outputs and its own columns of the window's d entries. It never writes what its
     siblings read.
  3. finish, per (row, key head): the window's keys (per key head), cumulative gates (per
     value head) and the new cursor word, recomputed from the inputs.
  Main reads the cursor word with a plain load (nothing writes it before finish); the
  kernel boundaries order every shared read before the write, so no atomics are needed there.

The cursor word (cursor.py) holds `n | p << 8` between launches (n committed entries, p the
pending window's length, both < 256); the finish programs of a row read it with tickets (the
last of the row's H programs writes the new word). A slot with p == 0 holds the plain entry
count that `ring_decode` and `ring_materialize` use; a slot with a pending window must go
through `ring_commit` (or this kernel) before those see it. Commit, verify and the window
bookkeeping thus need no host sync and no extra persistent buffer, and the launch is CUDA-graph
safe (everything it reads is a tensor; only the shapes and `max_tokens` are baked in).

How the tokens are computed (per value head and block of BV value rows: one main program).
With Gamma_t the cumulative log-decay up to token t (continuing from G_n, or from 0 after a
flush), the state after token t applied to a vector x is

    S_t x = exp(Gamma_t) S_c x + sum_{j<n} exp(Gamma_t - G_j) d_j (k_j . x)
                               + sum_{u<=t} exp(Gamma_t - Gamma_u) d_u (k_u . x)

and per value block one read of the checkpoint tile serves every token (d_t depends on d_u,
u < t):

    d_t = beta_t (v_t - alpha_t S_{t-1} k_t),   o_t = alpha_t S_{t-1} q_t + d_t (k_t . q_t).

The main kernel replays the committed entries into its tile first (S_n = exp(G_n) S_c +
sum_j exp(G_n - G_j) k_j d_j^T, n rank-1 updates, as the decode flush) and then runs the
window as the plain recurrence on S_n in registers (S <- alpha_t S; d_t = beta_t (v_t - S k_t);
o_t = S q_t + d_t (k_t . q_t); S += k_t d_t^T): per token two reductions over K and two
rank-1-sized updates of its own tile, no ring-sized work. A flushed tile is stored in the
state dtype and the window continues from the stored (rounded) checkpoint. The forms measured
and dropped are listed in docs/kernels.md.

Requirements: the valid rows of one launch name distinct slots (vLLM guarantees this);
1 <= max_tokens <= L <= 255; each row has at most `max_tokens` tokens (the launcher cannot
check device data without a host sync: tokens past max_tokens get no output and no entry).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .commit import committed_count
from .cursor import COUNT_MASK, PENDING_SHIFT_C, TICKET_C, TICKET_SHIFT_C
from .gdn_gates import gdn_beta, gdn_log_decay
from .launch import cdiv, next_pow2, verify_launch
from .ring_checks import check_device, check_packed_inputs, ring_geometry, rows_tensor


@triton.jit
def _row_window(cu, row, MAXT: tl.constexpr):
    """First token and token count (clamped to [0, MAXT]) of launch row `row`."""
    lo = tl.load(cu + row).to(tl.int64)
    W = (tl.load(cu + row + 1).to(tl.int64) - lo).to(tl.int32)
    return lo, tl.minimum(tl.maximum(W, 0), MAXT)


# --------------------------------------------------------------------------------------------
# Prep kernel per (row, key head), main kernel per (row, value head, block of BV
# value rows), finish kernel per (row, key head). The main kernel only READS the data its
# sibling programs share (ring keys, gates, cursor word) and writes only its own rows (outputs,
# ring d columns, checkpoint rows); the finish kernel, launched after it on the same stream,
# writes the shared data. The kernel boundaries order every shared read before the write, so
# the main kernel needs no atomics.
# --------------------------------------------------------------------------------------------

@triton.jit
def _ring_verify_prep_kernel(
    qkv, a, b, A_log, dt_bias, idx, cu, gates, qk,
    scale,
    stride_qkv, stride_a, stride_b, stride_idx,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BK: tl.constexpr, WP: tl.constexpr, GP: tl.constexpr, RW: tl.constexpr,
    MAXT: tl.constexpr, L2NORM: tl.constexpr,
):
    # Program = (row, key head), all tokens of the window at once: row t of gates[row, i_h]
    # (RW floats) = [k_t . q_t (both normalised, q scaled) | alpha_t per value head of the
    # group (GP) | beta_t per value head (GP) | pad].
    pid = tl.program_id(0)
    i_h = pid % H
    row = (pid // H).to(tl.int64)
    slot = tl.load(idx + row * stride_idx).to(tl.int64)
    if slot <= 0:
        return
    lo, W = _row_window(cu, row, MAXT)
    o_w = tl.arange(0, WP)
    o_k = tl.arange(0, BK)
    m_w = o_w < W
    tok = lo + o_w
    m_wk = m_w[:, None] & (o_k < K)[None, :]
    p_x = qkv + tok[:, None] * stride_qkv + i_h * K + o_k[None, :]
    Q = tl.load(p_x, mask=m_wk, other=0.0).to(tl.float32)
    Kt = tl.load(p_x + H * K, mask=m_wk, other=0.0).to(tl.float32)
    sq = tl.full([WP], scale, tl.float32)
    sk = tl.full([WP], 1.0, tl.float32)
    if L2NORM:
        sq = scale / tl.sqrt(tl.sum(Q * Q, 1) + 1e-6)
        sk = 1.0 / tl.sqrt(tl.sum(Kt * Kt, 1) + 1e-6)
    Q = Q * sq[:, None]
    Kt = Kt * sk[:, None]
    kq = tl.sum(Q * Kt, 1)
    # the normalised q_t, k_t in fp32 (qk[token, key head] = [q | k]), so the main kernel's
    # programs load them ready to use
    p_qk = qk + (tok[:, None] * H + i_h) * (2 * K) + o_k[None, :]
    tl.store(p_qk, Q, mask=m_wk)
    tl.store(p_qk + K, Kt, mask=m_wk)
    p_r = gates + (row * H + i_h) * (WP * RW) + o_w * RW
    tl.store(p_r, kq, mask=m_w)
    GROUP: tl.constexpr = HV // H
    o_g = tl.arange(0, GP)
    m_g = o_g < GROUP
    hvs = i_h * GROUP + o_g
    m_wg = m_w[:, None] & m_g[None, :]
    A_g = tl.load(A_log + hvs, mask=m_g, other=0.0).to(tl.float32)
    dtb_g = tl.load(dt_bias + hvs, mask=m_g, other=0.0).to(tl.float32)
    a_t = tl.load(a + tok[:, None] * stride_a + hvs[None, :], mask=m_wg, other=0.0).to(tl.float32)
    b_t = tl.load(b + tok[:, None] * stride_b + hvs[None, :], mask=m_wg, other=0.0).to(tl.float32)
    tl.store(p_r[:, None] + 1 + o_g[None, :], tl.exp(gdn_log_decay(a_t, A_g[None, :], dtb_g[None, :])), mask=m_wg)
    tl.store(p_r[:, None] + 1 + GP + o_g[None, :], gdn_beta(b_t), mask=m_wg)


@triton.jit
def _ring_verify_main_kernel(
    qkv, out, state, idx, cu, acc,
    ring_d, ring_k, ring_g, cursor, gates, qk,
    stride_qkv, stride_idx, stride_acc,
    slot_stride_state, slot_stride_d, slot_stride_k, slot_stride_g,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, WP: tl.constexpr, MAXT: tl.constexpr,
    NV: tl.constexpr, GP: tl.constexpr, RW: tl.constexpr, HAS_ACC: tl.constexpr, KI: tl.constexpr,
):
    # Program = (row, value head, BV value rows). The committed entries are replayed into the
    # checkpoint tile once (S_n = exp(G_n) S_c + sum_j exp(G_n - G_j) k_j d_j^T: rank-1
    # updates), then the window runs the plain recurrence on the tile in registers:
    #   S <- alpha_t S;  d_t = beta_t (v_t - S k_t);  o_t = S q_t + d_t (k_t . q_t);  S += k_t d_t^T
    # On a flush S_n is also stored (the new checkpoint) and the window continues from it.
    # The tile is [BV, BK / KI, KI] with KI = 16: Triton lays a load out along its contiguous
    # axis first, 16 bytes per lane, so KI puts 4 lanes on K and the other 8 of a warp on the
    # value rows; every lane holds BK / 4 keys of BV / 8 value rows, and a reduction over K is
    # sums inside the lane plus 2 shuffle rounds (a [BK, BV] tile puts all 32 lanes on K: 5
    # rounds per value row held). The q/k vectors (fp32, from prep) are loaded broadcast to the
    # tile's shape, so they arrive in its layout.
    pid = tl.program_id(0)
    jv = pid % NV
    hv = (pid // NV) % HV
    row = (pid // (NV * HV)).to(tl.int64)
    GROUP: tl.constexpr = HV // H
    i_h = hv // GROUP
    KC: tl.constexpr = BK // KI

    o_v = jv * BV + tl.arange(0, BV)
    o_v3 = o_v[:, None, None]  # [BV, 1, 1]
    o_k3 = tl.arange(0, KC)[None, :, None] * KI + tl.arange(0, KI)[None, None, :] + o_v3 * 0  # [BV, KC, KI]
    m_v = o_v < V
    m_v3 = o_v3 < V
    m_k3 = o_k3 < K
    m_s = m_k3 & m_v3
    o_w = tl.arange(0, WP)

    slot = tl.load(idx + row * stride_idx).to(tl.int64)
    lo, W = _row_window(cu, row, MAXT)
    if slot <= 0:
        # NULL block (0) or padding (-1): zero outputs for this block's rows, touch nothing else.
        p_o = out + ((lo + o_w)[:, None] * HV + hv) * V + o_v[None, :]
        tl.store(p_o, tl.zeros([WP, BV], dtype=tl.float32).to(out.dtype.element_ty),
                 mask=(o_w < W)[:, None] & m_v[None, :])
        return

    # The cursor word is unchanged during the launch (only the finish kernel writes it).
    n = committed_count(tl.load(cursor + slot), acc, row, stride_acc, L, HAS_ACC)
    flush = n + W > L
    n_w = tl.where(flush, 0, n)
    p_gr = ring_g + slot * slot_stride_g + hv * L
    G_n = tl.load(p_gr + n - 1, mask=n > 0, other=0.0)  # 0 for an empty ring

    p_s = state + slot * slot_stride_state + hv * (V * K) + o_v3 * K + o_k3
    S = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32) * tl.exp(G_n)
    p_dr = ring_d + slot * slot_stride_d + hv * (L * V)
    p_kr = ring_k + slot * slot_stride_k + i_h * (L * K)
    for j in range(0, n):
        w_j = tl.exp(G_n - tl.load(p_gr + j))
        d_j = tl.load(p_dr + j * V + o_v3, mask=m_v3, other=0.0).to(tl.float32)
        k_j = tl.load(p_kr + j * K + o_k3, mask=m_k3, other=0.0).to(tl.float32)
        S += k_j * (w_j * d_j)
    if flush:
        # stored in the state dtype; the window continues from the stored (rounded) checkpoint
        S = S.to(state.dtype.element_ty)
        tl.store(p_s, S, mask=m_s)
        S = S.to(tl.float32)
        tl.debug_barrier()  # every lane has read the d entries the window overwrites

    i_g = hv % GROUP
    p_gt = gates + (row * H + i_h) * (WP * RW)
    p_q = qk + i_h * (2 * K) + o_k3
    p_v = qkv + 2 * H * K + hv * V + o_v
    p_o = out + hv * V + o_v
    for t in range(0, W):
        tt = lo + t
        g_t = p_gt + t * RW
        q_t = tl.load(p_q + tt * (H * 2 * K), mask=m_k3, other=0.0)
        k_t = tl.load(p_q + tt * (H * 2 * K) + K, mask=m_k3, other=0.0)
        v_t = tl.load(p_v + tt * stride_qkv, mask=m_v, other=0.0).to(tl.float32)
        kq_t = tl.load(g_t)
        alpha = tl.load(g_t + 1 + i_g)
        beta_t = tl.load(g_t + 1 + GP + i_g)
        S = S * alpha
        d = beta_t * (v_t - tl.sum(tl.sum(S * k_t, 1), 1))
        o = tl.sum(tl.sum(S * q_t, 1), 1) + d * kq_t
        tl.store(p_o + tt * (HV * V), o.to(out.dtype.element_ty), mask=m_v)
        tl.store(p_dr + (n_w + t) * V + o_v, d.to(ring_d.dtype.element_ty), mask=m_v)
        # later tokens use d unrounded, as the sequential recurrence does
        S += k_t * d[:, None, None]


@triton.jit
def _ring_verify_finish_kernel(
    qkv, a, A_log, dt_bias, idx, cu, acc, ring_k, ring_g, cursor,
    stride_qkv, stride_a, stride_idx, stride_acc, slot_stride_k, slot_stride_g,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, L: tl.constexpr,
    BK: tl.constexpr, GP: tl.constexpr, WP: tl.constexpr, MAXT: tl.constexpr,
    HAS_ACC: tl.constexpr, L2NORM: tl.constexpr,
):
    # Program = (row, key head): the window's keys of this key head, the window's cumulative
    # gates of its GROUP value heads, and (last of the row's H programs) the new cursor word.
    pid = tl.program_id(0)
    i_h = pid % H
    row = (pid // H).to(tl.int64)
    GROUP: tl.constexpr = HV // H

    o_k = tl.arange(0, BK)
    o_w = tl.arange(0, WP)
    o_g = tl.arange(0, GP)
    m_k = o_k < K
    m_g = o_g < GROUP
    hvs = i_h * GROUP + o_g

    slot = tl.load(idx + row * stride_idx).to(tl.int64)
    if slot <= 0:
        return
    lo, W = _row_window(cu, row, MAXT)
    m_w = o_w < W
    tok = lo + o_w

    # The ticket makes the read of the word race-free against the row's last program's write.
    ticket = tl.atomic_add(cursor + slot, TICKET_C, sem="relaxed")
    arrivals = ticket >> TICKET_SHIFT_C
    n = committed_count(ticket, acc, row, stride_acc, L, HAS_ACC)
    flush = n + W > L
    n_w = tl.where(flush, 0, n)

    # keys: the same normalisation as the main kernel
    m_wk = m_w[:, None] & m_k[None, :]
    Kt = tl.load(qkv + tok[:, None] * stride_qkv + H * K + i_h * K + o_k[None, :], mask=m_wk,
                 other=0.0).to(tl.float32)
    if L2NORM:
        Kt = Kt / tl.sqrt(tl.sum(Kt * Kt, 1) + 1e-6)[:, None]
    p_kr = ring_k + slot * slot_stride_k + i_h * (L * K)
    tl.store(p_kr + (n_w + o_w)[:, None] * K + o_k[None, :], Kt.to(ring_k.dtype.element_ty), mask=m_wk)

    # gates: Gamma_t = G_n (0 after a flush) + cumulative g over the window, per value head
    m_wg = m_w[:, None] & m_g[None, :]
    A_t = tl.load(A_log + hvs, mask=m_g, other=0.0).to(tl.float32)
    dtb = tl.load(dt_bias + hvs, mask=m_g, other=0.0).to(tl.float32)
    a_t = tl.load(a + tok[:, None] * stride_a + hvs[None, :], mask=m_wg, other=0.0).to(tl.float32)
    g = tl.where(m_wg, gdn_log_decay(a_t, A_t[None, :], dtb[None, :]), 0.0)  # [WP, GP]
    p_g = ring_g + slot * slot_stride_g + hvs * L
    G_n = tl.load(p_g + n - 1, mask=m_g & ((o_g * 0 + n) > 0), other=0.0)  # [GP]; 0 if empty
    Gam = tl.where(flush, 0.0, G_n)[None, :] + tl.cumsum(g, 0)
    tl.store(p_g[None, :] + (n_w + o_w)[:, None], Gam, mask=m_wg)
    if arrivals == H - 1:
        # Last of the row's H programs to take a ticket: everyone has read the word.
        tl.atomic_xchg(cursor + slot, n_w | (W << PENDING_SHIFT_C), sem="relaxed")


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

def ring_verify(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    out: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ring_d: torch.Tensor,
    ring_k: torch.Tensor,
    ring_g: torch.Tensor,
    cursor: torch.Tensor,
    num_accepted: torch.Tensor | None,
    max_tokens: int,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One speculative step through the ring (semantics of `ring_spec_verify_reference`): commit
    each slot's previous window, then verify the row's tokens, whose entries become the slot's
    new pending window. No host sync; the small scratch comes from the caching allocator (under
    capture, from the graph's pool): CUDA-graph safe. The main kernel's launch is
    `launch.VerifyLaunch()` unless an `override_launch` block names another.

    Args:
        mixed_qkv (torch.Tensor):
            packed q | k | v of shape `[tokens, 2*H*K + HV*V]`, contiguous in its last dim.
        a (torch.Tensor), b (torch.Tensor):
            the gate inputs of shape `[tokens, HV]`.
        A_log (torch.Tensor), dt_bias (torch.Tensor):
            the layer's gate parameters, `HV` elements each, contiguous.
        scale (float):
            the query scale (applied after the L2 normalisation).
        state (torch.Tensor):
            the checkpoints, `[slots, HV, V, K]` (fp32, bf16 or fp16); updated in place where a
            window does not fit and the committed entries are flushed.
        out (torch.Tensor):
            contiguous, `tokens * HV * V` elements ([tokens, HV, V] or [tokens, 1, HV, V]):
            every token of every row is written (zero for rows with slot <= 0), tokens outside
            every row are left untouched.
        state_indices (torch.Tensor):
            the slot of each row, 1-D `[rows]`; rows with slot <= 0 are padding.
        cu_seqlens (torch.Tensor):
            row i owns tokens cu_seqlens[i]:cu_seqlens[i+1] (at most `max_tokens` of them),
            contiguous int32 or int64 with at least rows + 1 entries.
        ring_d (torch.Tensor), ring_k (torch.Tensor), ring_g (torch.Tensor):
            the rings, `[slots, HV, L, V]`, `[slots, H, L, K]`, `[slots, HV, L]` (float32).
        cursor (torch.Tensor):
            packed cursor words `n | pending << 8` (cursor.py), contiguous int32 `[slots]`.
        num_accepted (torch.Tensor | None):
            tokens accepted per row in the previous step, committing that pending window first;
            None drops it.
        max_tokens (int):
            the most tokens a row has, in [1, L] (tokens past it get no output and no entry:
            the launcher cannot check device data without a host sync).
        use_qk_l2norm (bool):
            L2-normalise q and k (as vLLM's GDN layers do).

    Returns:
        `out` viewed as `[tokens, HV, V]`. State, rings and cursor are updated in place.
    """
    H, HV, K, V, L, (ss, sd, sk, sg) = ring_geometry(state, ring_d, ring_k, ring_g, cursor, COUNT_MASK)
    ntok = check_packed_inputs(mixed_qkv, a, b, A_log, dt_bias, H, HV, K, V)
    if state_indices.ndim != 1:
        raise ValueError(f"state_indices must be 1-D (got {tuple(state_indices.shape)})")
    N = state_indices.shape[0]
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < N + 1 or not cu_seqlens.is_contiguous():
        raise ValueError(f"cu_seqlens must be contiguous 1-D with at least N+1 = {N + 1} entries "
                         f"(got {tuple(cu_seqlens.shape)})")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64 (got {cu_seqlens.dtype})")
    if not out.is_contiguous() or out.numel() != ntok * HV * V:
        raise ValueError(f"out must be contiguous with tokens*HV*V = {ntok * HV * V} elements")
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= L:
        raise ValueError(f"max_tokens must be an int in [1, L={L}] (got {max_tokens!r})")
    dev = state.device
    check_device(dev, mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, out=out,
                 state_indices=state_indices, cu_seqlens=cu_seqlens)
    acc, s_acc = rows_tensor(num_accepted, N, "num_accepted", dev)
    out3 = out.view(ntok, HV, V)
    if N == 0:
        return out3
    launch = verify_launch()
    BV = min(launch.block_v, max(16, next_pow2(V)))
    BK = max(16, next_pow2(K))
    WP = max(16, next_pow2(max_tokens))
    acc_arg = acc if acc is not None else state_indices
    GP = next_pow2(HV // H)
    NV = cdiv(V, BV)
    # Per-token scalars and the normalised q/k, in scratch that under CUDA-graph capture
    # comes from the graph's memory pool.
    RW = next_pow2(1 + 2 * GP)
    gates = torch.empty((N, H, WP, RW), dtype=torch.float32, device=dev)
    qk = torch.empty((ntok, H, 2, K), dtype=torch.float32, device=dev)
    _ring_verify_prep_kernel[(N * H,)](
        mixed_qkv, a, b, A_log, dt_bias, state_indices, cu_seqlens, gates, qk, float(scale),
        mixed_qkv.stride(0), a.stride(0), b.stride(0), state_indices.stride(0),
        H=H, HV=HV, K=K, BK=BK, WP=WP, GP=GP, RW=RW, MAXT=max_tokens, L2NORM=bool(use_qk_l2norm),
        num_warps=4, num_stages=1,
    )
    _ring_verify_main_kernel[(N * HV * NV,)](
        mixed_qkv, out, state, state_indices, cu_seqlens, acc_arg,
        ring_d, ring_k, ring_g, cursor, gates, qk,
        mixed_qkv.stride(0), state_indices.stride(0), s_acc, ss, sd, sk, sg,
        H=H, HV=HV, K=K, V=V, L=L, BK=BK, BV=BV, WP=WP, MAXT=max_tokens, NV=NV,
        GP=GP, RW=RW, HAS_ACC=acc is not None, KI=min(BK, 16), num_warps=launch.num_warps, num_stages=1,
    )
    # Same stream, after the main kernel: the shared keys, gates and cursor words.
    _ring_verify_finish_kernel[(N * H,)](
        mixed_qkv, a, A_log, dt_bias, state_indices, cu_seqlens, acc_arg,
        ring_k, ring_g, cursor,
        mixed_qkv.stride(0), a.stride(0), state_indices.stride(0), s_acc, sk, sg,
        H=H, HV=HV, K=K, L=L, BK=BK, GP=max(2, next_pow2(HV // H)), WP=WP, MAXT=max_tokens,
        HAS_ACC=acc is not None, L2NORM=bool(use_qk_l2norm),
        num_warps=4 if WP * BK > 2048 else 2, num_stages=1,
    )
    return out3
