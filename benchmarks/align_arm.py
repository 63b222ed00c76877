"""One arm of tests/gpu/test_align_mtp_gpu.py alone: its engine (MTP T=3, prefix caching in align
mode, the test's tiny checkpoint and config) started and given one short request, for running
under a tool. Issue 47: the patched arm's engine stopped with an illegal memory access on vLLM 0.34,
in vLLM's own FLA prefill kernel under the Triton autotuner (benchmarks/results/vllm034/README.md);
`bash benchmarks/gpu_run.sh alignsan` runs this under compute-sanitizer's memcheck, which names the
kernel and the access.

    python benchmarks/align_arm.py patched|native [--head-dim 64|128] [--prefill triton|flashinfer] [--workdir DIR]
    python benchmarks/align_arm.py kernels [--head-dim 64|128]

An arm runs as in the test, with GDN heads of `--head-dim` (the test's are 128; at 64 its patched
engine stopped), through `engine_runner.run_arm` (vLLM's multiprocessing, strict, shadow and
poisoned rings); its logs (ARM.out.log, ARM.err.log) go to DIR. `kernels` runs no engine: only
vLLM's FLA `chunk_gated_delta_rule` once, as vLLM's prefill-kernel warmup calls it (64 tokens, the
tiny checkpoints' 2 key / 4 value heads of `--head-dim`, autotuning included), so a fault there is
vLLM's and Triton's, whatever the package does.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile

TEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu", "test_align_mtp_gpu.py")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("arm", choices=["patched", "native", "kernels"])
    ap.add_argument("--head-dim", type=int, choices=[64, 128], default=64,
                    help="the GDN head dim (64: where the patched arm's engine stopped on vLLM 0.34)")
    ap.add_argument("--prefill", choices=["triton", "flashinfer"], default="triton")
    ap.add_argument("--workdir", default=None, help="where the arm's logs go (default: a new temporary folder)")
    args = ap.parse_args()
    if args.arm == "kernels":
        return fla_prefill_once(args.head_dim)
    spec = importlib.util.spec_from_file_location("align_test", TEST)  # the test's checkpoint and engine
    test = importlib.util.module_from_spec(spec)
    import pytest

    try:
        spec.loader.exec_module(test)
    except pytest.skip.Exception as e:  # the test's own requirement (a CUDA GPU, vLLM >= 0.32)
        raise SystemExit(f"align_arm.py: {e.msg}") from None
    from replayssm_patch.testing import cache_dir
    from replayssm_patch.testing.engine_runner import run_arm
    from replayssm_patch.testing.tiny_models import DECISIVE, build_tiny_model

    model = str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen3_5", mtp_layers=1, echo_drafts=True,
                                 **DECISIVE, **dict(test.SMALL_BLOCKS, gdn_head_dim=args.head_dim)))
    from vllm.engine.arg_utils import EngineArgs

    engine = dict(test.ENGINE, gdn_prefill_backend=args.prefill)
    if "prefix_cache_retention_interval" in EngineArgs.__dataclass_fields__:  # vLLM >= 0.34, as the test
        engine["prefix_cache_retention_interval"] = None
    engines = [{"name": "align", "engine": engine, "prompts": [[5 + i % 50 for i in range(test.PROMPT_LENS[0])]],
                "max_tokens": [8]}]
    workdir = args.workdir or tempfile.mkdtemp(prefix=f"align-{args.arm}-")
    os.makedirs(workdir, exist_ok=True)
    print(f"[align arm] {args.arm}: logs in {workdir}", flush=True)
    run_arm(workdir, args.arm, {"model": model, "patched": args.arm == "patched", "allow_mtp": True,
                                "strict": True, "ring_len": 16, "engines": engines}, mp=True)
    print(f"[align arm] {args.arm}: served")


def fla_prefill_once(head_dim: int, tokens: int = 64, key_heads: int = 2, value_heads: int = 4) -> None:
    """vLLM's FLA chunked prefill once on random inputs of the warmup's shape (`_warmup_prefill_kernels`
    in vLLM 0.34's GDN layer), then a device sync, so that a fault surfaces here."""
    import torch
    from gdn_prefill_memory import chunk_op  # this script's folder is on sys.path when run as a script

    chunk_gated_delta_rule = chunk_op()
    dev = "cuda"
    gen = torch.Generator(dev).manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=gen)

    q = torch.nn.functional.normalize(rand(1, tokens, key_heads, head_dim, dtype=torch.float32), dim=-1)
    k = torch.nn.functional.normalize(rand(1, tokens, key_heads, head_dim, dtype=torch.float32), dim=-1)
    v = rand(1, tokens, value_heads, head_dim)
    g = -torch.nn.functional.softplus(rand(1, tokens, value_heads, dtype=torch.float32))  # log decay < 0
    beta = torch.sigmoid(rand(1, tokens, value_heads))
    state = torch.zeros(1, value_heads, head_dim, head_dim, device=dev, dtype=torch.float32)
    cu_seqlens = torch.tensor([0, tokens], device=dev, dtype=torch.int32)
    out, final = chunk_gated_delta_rule(q=q.to(torch.bfloat16), k=k.to(torch.bfloat16), v=v, g=g, beta=beta,
                                        initial_state=state, output_final_state=True, cu_seqlens=cu_seqlens,
                                        use_qk_l2norm_in_kernel=False)
    torch.cuda.synchronize()
    print(f"[align arm] kernels: FLA chunk_gated_delta_rule at head dim {head_dim}: ran, output finite "
          f"{bool(torch.isfinite(out).all() and torch.isfinite(final).all())}")


if __name__ == "__main__":
    main()
