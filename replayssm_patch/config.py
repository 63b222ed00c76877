"""The user's options, declared once: `ReplayConfig`.

Each field's metadata (`Option`) names its environment variable, how a value is parsed, the
accepted values and a help line; `patch()` keywords, the environment, the `doctor` flags and
`status()` all come from that table. The environment is the channel between vLLM's processes
(front end, engine core, workers: each starts with a copy of it); inside a process the config is
read once, by `patch()` or the plugin, and then passed on.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


class OptionError(ValueError):
    """A user-supplied option has a value outside the accepted set."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
MAX_MIN_BATCH = 1 << 16


@dataclass(frozen=True)
class Option:
    """How one ReplayConfig field is given: its variable, parser, accepted values and help."""

    env: str
    parse: Callable[[str, Any], Any]  # (name shown in errors, raw value) -> value; raises OptionError
    accepted: str
    help: str
    user: bool = True  # False: a testing aid, read from the environment only


def _bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        v = value.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
    raise OptionError(f"{name}={value!r} is not accepted; accepted values: 0/1, true/false, yes/no, on/off")


def _int_text(value) -> int | None:
    """`value` as an integer if it is written as one (not a bool, not a float's text), else None."""
    if isinstance(value, bool):
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def _ring_len(name: str, value) -> int:
    n = _int_text(value)
    if n is None or not 1 <= n <= 64:
        raise OptionError(f"{name}={value!r} is not accepted; accepted values: integers 1..64 (default 16)")
    return n


def _min_batch(name: str, value) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    n = _int_text(value)
    if n is None or not 1 <= n <= MAX_MIN_BATCH:
        raise OptionError(f"{name}={value!r} is not accepted; accepted values: auto (the plan decides), "
                          f"or an integer 1..{MAX_MIN_BATCH} (the smallest decode batch served by the ring)")
    return n


def _mtp(name: str, value) -> str:
    if isinstance(value, str) and value.strip().lower() in ("auto", "ring", "native"):
        return value.strip().lower()
    try:
        return "ring" if _bool(name, value) else "native"
    except OptionError:
        raise OptionError(f"{name}={value!r} is not accepted; accepted values: auto (the plan decides), "
                          "ring or 1/true/on, native or 0/false/off") from None


def _choice(*accepted: str):
    def parse(name: str, value) -> str:
        v = str(value).strip().lower()
        if v not in accepted:
            raise OptionError(f"{name}={value!r} is not accepted; accepted values: {', '.join(accepted)}")
        return v

    return parse


def _opt(default, env, parse, accepted, help, user=True):
    return field(default=default, metadata={"option": Option(env, parse, accepted, help, user)})


@dataclass(frozen=True)
class ReplayConfig:
    """What the user asked for. Every field is an option of `patch()`, `doctor` and the
    environment (see `options()`); README "Options" lists them."""

    enable: bool = _opt(False, "VLLM_GDN_REPLAYSSM", _bool, "0/1 (also true/false, yes/no, on/off)",
                        "serve GDN decode through the ring where the plan says it pays; off: vLLM native")
    ring_len: int = _opt(16, "VLLM_GDN_REPLAYSSM_RING", _ring_len, "1..64",
                         "replay entries per cache slot: the checkpoint is written once every ring_len decode steps")
    min_batch: int | str = _opt("auto", "VLLM_GDN_REPLAYSSM_MIN_BATCH", _min_batch, "auto or 1..65536",
                                "plain decode steps with fewer rows decode natively; auto: the plan, from the "
                                "model's shapes, the kernel table and the memory the ring costs")
    allow_mtp: str = _opt("auto", "VLLM_GDN_REPLAYSSM_MTP", _mtp, "auto, ring (also 1/true), native (also 0/false)",
                          "MTP speculative decoding through the ring (one state slot per request instead of 1+T); "
                          "auto: the plan")
    ring_dtype: str = _opt("auto", "VLLM_GDN_REPLAYSSM_RING_DTYPE", _choice("auto", "activation", "float32"),
                           "auto, activation, float32",
                           "dtype of the ring's d/k entries; auto: fp32 for an fp32 state, else the activation dtype")
    mtp_kernel: str = _opt("triton", "VLLM_GDN_REPLAYSSM_MTP_KERNEL", _choice("triton", "flashinfer"),
                           "triton, flashinfer",
                           "the MTP verify kernel on CUDA: ours, or FlashInfer's (bf16 state, T = 3 or 7, Hopper+)")
    strict: bool = _opt(False, "VLLM_GDN_REPLAYSSM_STRICT", _bool, "0/1",
                        "raise instead of falling back to vLLM's native decode where the ring cannot serve")
    shadow: bool = _opt(False, "VLLM_GDN_REPLAYSSM_SHADOW", _bool, "0/1",
                        "testing aid (CPU): check every ring decode against vLLM's kernel on exact states",
                        user=False)
    poison: bool = _opt(False, "VLLM_GDN_REPLAYSSM_POISON_UNUSED", _bool, "0/1",
                        "testing aid: garbage in every ring nobody started", user=False)

    def to_env(self) -> dict[str, str]:
        """The variables that give this config to a process vLLM starts."""
        out = {}
        for f, opt in options():
            v = getattr(self, f.name)
            out[opt.env] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f, _ in options()}


def options() -> list[tuple[dataclasses.Field, Option]]:
    """ReplayConfig's fields with their Option, in declaration order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(ReplayConfig)]


# Variables that were renamed or removed: refused with what to do instead, never ignored
# (ignoring one would silently change what an engine serves).
RETIRED = {
    "VLLM_GDN_REPLAYSSM_MTP_CUDA": "was renamed VLLM_GDN_REPLAYSSM_MTP (the MTP option covers CPU too); "
                                   "set VLLM_GDN_REPLAYSSM_MTP={value} instead",
    "VLLM_GDN_REPLAYSSM_16BIT_STATE": "was removed: the plan decides 16-bit states as it decides fp32 ones; "
                                      "unset it (set VLLM_GDN_REPLAYSSM_MIN_BATCH to force the ring)",
}


def from_kwargs(environ: Mapping[str, str] | None = None, **kwargs) -> ReplayConfig:
    """A config from `patch()` keywords, each checked by its field's parser (an unknown keyword or
    a bad value raises OptionError naming it); the testing aids, which are no keywords, from the
    environment (os.environ by default)."""
    env = os.environ if environ is None else environ
    aids = {f.name: opt.parse(opt.env, env[opt.env]) for f, opt in options()
            if not opt.user and env.get(opt.env, "").strip()}
    fields = {f.name: opt for f, opt in options() if opt.user}
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        raise OptionError(f"unknown option(s) {unknown}; accepted: {', '.join(fields)}")
    values = {}
    for name, value in kwargs.items():
        if isinstance(value, bool) and fields[name].parse not in (_bool, _mtp):
            raise OptionError(f"{name}={value!r} is not accepted; accepted values: {fields[name].accepted}")
        if fields[name].parse is _bool and not isinstance(value, bool):
            raise OptionError(f"{name}={value!r} is not accepted; accepted values: True, False")
        values[name] = fields[name].parse(name, value)
    return ReplayConfig(**aids, **values)


def from_env(environ: Mapping[str, str] | None = None) -> ReplayConfig:
    """The config in the environment (os.environ by default). Unset or blank variables take their
    defaults; with VLLM_GDN_REPLAYSSM off nothing else is read. A bad value raises OptionError
    naming the variable and its accepted values."""
    env = os.environ if environ is None else environ

    def raw(name: str) -> str | None:
        value = env.get(name, "")
        return value if value.strip() else None

    enable_field, enable_opt = options()[0]
    if raw(enable_opt.env) is None or not enable_opt.parse(enable_opt.env, raw(enable_opt.env)):
        return ReplayConfig()
    for name, what in RETIRED.items():
        if raw(name) is not None:
            raise OptionError(f"{name} " + what.format(value=raw(name).strip()))
    values = {f.name: opt.parse(opt.env, raw(opt.env)) for f, opt in options() if raw(opt.env) is not None}
    return ReplayConfig(**values)


VLLM_FLAG_RING_LEN = "--replayssm-buffer-len"  # vLLM's own flag, taken as ring_len (replayssm_patch.vllm.replayssm_flag)
# what vLLM's --use-replayssm asks for in place of these options' defaults: the ring wherever it
# can serve, not only where the plan predicts a gain (the user asked for ReplaySSM)
VLLM_FLAG_DEFAULTS = {"min_batch": 1, "allow_mtp": "ring"}


def from_vllm_flag(buffer_len, environ: Mapping[str, str] | None = None) -> ReplayConfig:
    """The config vLLM's `--use-replayssm --replayssm-buffer-len N` (or `LLM(use_replayssm=True,
    replayssm_buffer_len=N)`) asks for: enabled, ring_len N (outside 1..64 an OptionError naming
    --replayssm-buffer-len), min_batch 1 and MTP through the ring. An option the environment
    gives a value other than its default (VLLM_GDN_REPLAYSSM_MIN_BATCH=64, a testing aid, ...)
    still applies, parsed as from_env() parses it; a default there (as patch() and unpatch()
    write them) is no choice and gives way to the flag's."""
    ring_len = _ring_len(VLLM_FLAG_RING_LEN, buffer_len)
    env = dict(os.environ if environ is None else environ, VLLM_GDN_REPLAYSSM="1")
    given, default = from_env(env), ReplayConfig()
    flag = {k: v for k, v in VLLM_FLAG_DEFAULTS.items() if getattr(given, k) == getattr(default, k)}
    return dataclasses.replace(given, ring_len=ring_len, **flag)


def declare_to_vllm() -> None:
    """Tell vLLM our variables are known: it warns about (or, with `fail_on_environ_validation`,
    refuses) every VLLM_* variable its own table lacks."""
    try:
        from vllm import envs
    except Exception:  # vLLM absent or broken: nothing to declare to
        return
    for _, opt in options():
        envs.environment_variables.setdefault(opt.env, lambda name=opt.env: os.environ.get(name))
