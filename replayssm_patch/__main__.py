"""`python -m replayssm_patch doctor [MODEL] [options]`: would the patch apply here, and to what?

Prints the vLLM version and platform, whether the patch would apply in this environment (the
version gate and every patch-point probe), and, for a model (a local path, or a Hugging Face id
already in the local cache), which GDN layers would decode through the ring, the ring's cache
memory per request, and every reason for falling back to vLLM's native decode.
"""

from __future__ import annotations

import argparse
import sys

from . import options as opts_mod


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _gdn_layer_count(hf_config) -> int:
    """GDN layers a config declares: its `linear_attention` layer types, else (configs with
    GDN dimensions but no layer list) every layer; 0 for a model without GDN dimensions."""
    types = getattr(hf_config, "layer_types", None)
    if types:
        return sum(t == "linear_attention" for t in types)
    if not hasattr(hf_config, "linear_num_value_heads"):
        return 0
    return int(getattr(hf_config, "num_hidden_layers", 0))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def doctor(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m replayssm_patch doctor", description=__doc__)
    ap.add_argument("model", nargs="?", help="model directory or cached Hugging Face id")
    ap.add_argument("--ring-len", type=int, default=None, help="ring length (default: env or 16)")
    ap.add_argument("--ring-dtype", default=None, choices=opts_mod.RING_DTYPES)
    ap.add_argument("--min-batch", default=None,
                    help="smallest plain-decode batch served by the ring: auto or an integer (default: env or auto)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--dtype", default="auto", help="activation dtype, as vLLM's --dtype")
    ap.add_argument("--mamba-ssm-cache-dtype", default="auto", help="as vLLM's --mamba-ssm-cache-dtype")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--num-speculative-tokens", type=int, default=0, help="MTP draft tokens")
    args = ap.parse_args(argv)

    try:
        env_opts = opts_mod.from_env()
        o = opts_mod.Options(
            enabled=True,
            ring_len=(opts_mod.check_ring_len("--ring-len", args.ring_len) if args.ring_len is not None
                      else env_opts.ring_len),
            ring_dtype=opts_mod.check_ring_dtype("--ring-dtype", args.ring_dtype or env_opts.ring_dtype),
            # the environment's switches count, as they would in an engine started from this shell
            # (VLLM_GDN_REPLAYSSM_MTP defaults to off: MTP stays native unless =1)
            allow_16bit_state=env_opts.allow_16bit_state,
            allow_mtp=env_opts.allow_mtp,
            mtp_kernel=env_opts.mtp_kernel,
            min_batch=(opts_mod.check_min_batch("--min-batch", args.min_batch) if args.min_batch is not None
                       else env_opts.min_batch),
        )
    except opts_mod.OptionError as e:
        ap.error(str(e))  # a usage error: exit status 2
    from . import decisions, patching, versions

    version = versions.installed_vllm_version()
    print(f"vLLM: {version or 'not installed'} (supported {versions.SUPPORTED_RANGE})")
    if version is None:
        return 1
    platform = decisions.platform()
    print(f"platform: {platform}")
    print(f"enabled by environment: {env_opts.enabled} (VLLM_GDN_REPLAYSSM)")
    reasons = patching._refusal_reasons(platform)
    print("patch would apply: " + ("yes" if not reasons else "no"))
    for r in reasons:
        print(f"  - {r}")
    if not args.model:
        return 0 if not reasons else 1

    from vllm.engine.arg_utils import EngineArgs

    ea = EngineArgs(model=args.model, skip_tokenizer_init=True, dtype=args.dtype,
                    tensor_parallel_size=args.tensor_parallel_size,
                    mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                    enable_prefix_caching=not args.no_prefix_caching)
    if args.num_speculative_tokens:
        ea.speculative_config = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    try:
        vllm_config = ea.create_engine_config()
    except Exception as e:  # a missing path, an unknown Hub id, a config vLLM cannot serve
        print(f"model: cannot read the configuration of {args.model!r}: {_first_line(e)}")
        return 2
    from .model_hooks import builds_qwen_gdn_layers
    from .ring_plan import plan_for

    mc = vllm_config.model_config
    plan, why = plan_for(vllm_config, o)
    n_layers = _gdn_layer_count(mc.hf_text_config)
    print(f"model: {args.model} ({mc.architecture}), {n_layers} GDN layers, "
          f"mamba_cache_mode={vllm_config.cache_config.mamba_cache_mode}")
    if plan is not None:
        # the patch replaces exactly vLLM's Qwen GDN layer class: other GDN layers stay native
        ok, reason = builds_qwen_gdn_layers(vllm_config)
        if not ok:
            plan, why = None, [reason]
    if plan is None:
        print("GDN layers: vLLM's native decode, because:")
        for r in why:
            print(f"  - {r}")
        return 1
    when = "every speculative step" if plan.spec_tokens else f"plain decode steps of >= {plan.min_batch} rows"
    print(f"GDN layers: all {n_layers} decode through the ring on {when} (L={plan.ring_len}, ring "
          f"{plan.ring_dtype}, state {plan.state_dtype}; per rank: {plan.num_k_heads} key / {plan.num_v_heads} "
          "value heads)")
    state, ring = plan.state_bytes_per_slot * n_layers, plan.bytes_per_slot * n_layers
    print(f"cache per request and cache slot (all GDN layers, one rank): state {_mib(state)}, "
          f"ring +{_mib(ring)} (+{100 * ring / state:.1f}%)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "doctor":
        print("usage: python -m replayssm_patch doctor [MODEL] [options]  (--help for options)")
        return 2
    return doctor(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
