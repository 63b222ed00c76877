"""One arm of tests/gpu/test_align_mtp_gpu.py alone: its engine (MTP T=3, prefix caching in align
mode, the test's tiny checkpoint and config) started and given one short request, for running
under a tool. Issue 47: the patched arm's engine stopped with an illegal memory access on vLLM 0.34
(benchmarks/results/vllm034/README.md); `bash benchmarks/gpu_run.sh alignsan` runs this under
compute-sanitizer's memcheck, which names the kernel and the access.

    python benchmarks/align_arm.py patched|native [--prefill triton|flashinfer] [--workdir DIR]

The arm runs as in the test (`engine_runner.run_arm`, vLLM's multiprocessing, strict, shadow and
poisoned rings); its logs (ARM.out.log, ARM.err.log) go to DIR.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile

TEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu", "test_align_mtp_gpu.py")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("arm", choices=["patched", "native"])
    ap.add_argument("--prefill", choices=["triton", "flashinfer"], default="triton")
    ap.add_argument("--workdir", default=None, help="where the arm's logs go (default: a new temporary folder)")
    args = ap.parse_args()
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

    shape = dict(test.SMALL_BLOCKS, gdn_head_dim=128) if args.prefill == "flashinfer" else test.SMALL_BLOCKS
    model = str(build_tiny_model(str(cache_dir() / "tiny-models"), "qwen3_5", mtp_layers=1, echo_drafts=True,
                                 **DECISIVE, **shape))
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


if __name__ == "__main__":
    main()
