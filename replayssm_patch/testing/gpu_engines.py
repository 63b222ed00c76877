"""What the GPU tests that start real vLLM engines (tests/gpu/) share: the skip of a module that
cannot run here, and the engine arguments each starts from."""

from __future__ import annotations

# The GPU host's vLLM comes without FlashAttention's binaries and runs the Triton GDN prefill
# (benchmarks/gpu_run.sh); otherwise vLLM's defaults. Each test adds its batch, caching and graphs.
ENGINE = dict(load_format="safetensors", dtype="bfloat16", max_model_len=512, skip_tokenizer_init=True, seed=0,
              gpu_memory_utilization=0.3, mamba_ssm_cache_dtype="float32", attention_backend="TRITON_ATTN",
              gdn_prefill_backend="triton")


def require_cuda(vllm_min: str | None = None, why: str = "") -> None:
    """Skip the test module calling this (at import) without a CUDA GPU, or, with `vllm_min`,
    where the installed vLLM is older (`why`: what needs that release)."""
    import pytest

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU", allow_module_level=True)
    if vllm_min is not None:
        vllm = pytest.importorskip("vllm")
        from packaging.version import Version

        if Version(Version(vllm.__version__).base_version) < Version(vllm_min):
            pytest.skip(f"{why}: vLLM >= {vllm_min}", allow_module_level=True)
