"""`python -m replayssm_patch doctor [MODEL] [options]`: would the patch apply here, and to what?

Prints the vLLM version and platform, whether the patch would apply in this environment (the
version gate and every patch-point probe) and, for a model (a local directory, or a Hugging Face
id already in the local cache: doctor never downloads), which GDN layers the plan puts on the
ring, the ring's cache memory per request, and every reason for vLLM's native decode.

Exit status: 0 the ring would serve (or, without a model, the patch would apply); 1 it would
not (the reasons are printed); 2 a usage error (a bad option, a model doctor cannot read).
"""

from __future__ import annotations

import argparse
import os
import sys

from . import config as cfg

USAGE = "python -m replayssm_patch doctor [MODEL] [options]"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _gdn_layer_count(hf_config) -> int:
    """GDN layers a config declares: its `linear_attention` layer types, else (configs with GDN
    dimensions but no layer list) every layer; 0 for a model without GDN dimensions."""
    types = getattr(hf_config, "layer_types", None)
    if types:
        return sum(t == "linear_attention" for t in types)
    if not hasattr(hf_config, "linear_num_value_heads"):
        return 0
    return int(getattr(hf_config, "num_hidden_layers", 0))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m replayssm_patch doctor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="model directory or cached Hugging Face id")
    ring = ap.add_argument_group("replayssm options (default: the environment's, when VLLM_GDN_REPLAYSSM=1, "
                                 "else the package's)")
    for f, opt in cfg.options():
        if opt.user and f.name != "enable":
            ring.add_argument("--" + f.name.replace("_", "-"), default=None, metavar="VALUE",
                              help=f"{opt.help} [{opt.accepted}; {opt.env}]")
    engine = ap.add_argument_group("the engine (as vLLM's own flags)")
    engine.add_argument("--tensor-parallel-size", type=int, default=1)
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--mamba-ssm-cache-dtype", default="auto")
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--num-speculative-tokens", type=int, default=0, help="MTP draft tokens")
    engine.add_argument("--max-num-seqs", type=int, default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--gpu-memory-utilization", type=float, default=None)
    return ap


def _config(ap, args) -> cfg.ReplayConfig:
    """The environment's config (when it enables the patch) with the flags given on top."""
    try:
        values = {**cfg.from_env().as_dict(), "enable": True}
        for f, opt in cfg.options():
            raw = getattr(args, f.name, None) if opt.user and f.name != "enable" else None
            if raw is not None:
                values[f.name] = opt.parse("--" + f.name.replace("_", "-"), raw)
        return cfg.ReplayConfig(**values)
    except cfg.OptionError as e:
        ap.error(str(e))  # a usage error: exit status 2


def _engine_config(args):
    from vllm.engine.arg_utils import EngineArgs

    kw = dict(model=args.model, skip_tokenizer_init=True, dtype=args.dtype,
              tensor_parallel_size=args.tensor_parallel_size, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
              enable_prefix_caching=not args.no_prefix_caching)
    for name in ("max_num_seqs", "max_model_len", "gpu_memory_utilization"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    ea = EngineArgs(**kw)
    if args.num_speculative_tokens:
        ea.speculative_config = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    return ea.create_engine_config()


def doctor(argv: list[str]) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    config = _config(ap, args)
    from . import activation, versions

    version = versions.installed_vllm_version()
    print(f"vLLM: {version or 'not installed'} (supported {versions.SUPPORTED_RANGE})")
    if version is None:
        return 1
    platform = versions.platform_name()
    print(f"platform: {platform}")
    print(f"enabled by environment: {cfg.from_env().enable} (VLLM_GDN_REPLAYSSM)")
    reasons = activation.refusal_reasons(platform)
    print("patch would apply: " + ("yes" if not reasons else "no"))
    for r in reasons:
        print(f"  - {r}")
    if not args.model:
        return 0 if not reasons else 1
    if not os.path.isdir(args.model) and (args.model.startswith((".", "/", "~")) or os.sep * 2 in args.model):
        print(f"model: {args.model!r} is not a directory")
        return 2
    if not os.path.isdir(args.model):
        os.environ["HF_HUB_OFFLINE"] = "1"  # a Hub id: the local cache only, no download or retries
    try:
        vllm_config = _engine_config(args)
    except Exception as e:  # an uncached Hub id, a config vLLM cannot serve: every line of it
        print(f"model: cannot read the configuration of {args.model!r}: {type(e).__name__}: {str(e).strip()}")
        return 2
    from .plan import device_memory, make_plan
    from .vllm.model_class import builds_qwen_gdn_layers

    mc = vllm_config.model_config
    plan = make_plan(vllm_config, config, device_memory())
    n_layers = _gdn_layer_count(mc.hf_text_config)
    print(f"model: {args.model} ({mc.architecture}), {n_layers} GDN layers, "
          f"mamba_cache_mode={vllm_config.cache_config.mamba_cache_mode}")
    why = [f"[{r.kind}] {r.text}" for r in plan.reasons]
    if plan.serves:
        ok, reason = builds_qwen_gdn_layers(vllm_config)  # the patch replaces vLLM's Qwen GDN class only
        if not ok:
            why = [f"[unsupported] {reason}"]
    if why:
        print("GDN layers: vLLM's native decode, because:")
        for r in why:
            print(f"  - {r}")
        return 1
    g = plan.geometry
    print(plan.describe(mc.architecture).replace("replayssm_patch: ", "GDN layers: "))
    state, ring = g.state_bytes_per_slot * n_layers, g.bytes_per_slot * n_layers
    print(f"cache per request and cache slot (all GDN layers, one rank): state {_mib(state)}, "
          f"ring +{_mib(ring)} (+{100 * ring / state:.1f}%)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: {USAGE}\n\n{__doc__}\n`python -m replayssm_patch doctor --help` lists the options.")
        return 0
    if not argv or argv[0] != "doctor":
        print(f"usage: {USAGE}  (--help for the options)", file=sys.stderr)
        return 2
    return doctor(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
