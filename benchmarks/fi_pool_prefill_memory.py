"""Memory of one GDN prefill step through FlashInfer's prefill: vLLM's form (states gathered in
fp32, final states returned, scattered back) against a ring layer's pool form
(replayssm_patch/vllm/flashinfer_pool_prefill.py), on a CUDA GPU with FlashInfer; vLLM not needed.
Prints one JSON line per form: the allocator's peak above what was live before the step."""

from __future__ import annotations

import argparse
import json
from itertools import accumulate

import torch
import torch.nn.functional as F

from replayssm_patch.vllm import flashinfer_pool_prefill


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seqs", type=int, default=1024)
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--value-heads", type=int, default=32)
    ap.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32")
    a = ap.parse_args()
    from flashinfer.gdn_prefill import chunk_gated_delta_rule

    dev, D, dtype = "cuda", 128, getattr(torch, a.state_dtype)
    base, extra = divmod(a.tokens, a.seqs)
    cu = torch.tensor([0, *accumulate(base + (i < extra) for i in range(a.seqs))], dtype=torch.int32, device=dev)
    q = F.normalize(torch.randn(1, a.tokens, a.key_heads, D, device=dev), dim=-1).bfloat16()
    k = F.normalize(torch.randn(1, a.tokens, a.key_heads, D, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, a.tokens, a.value_heads, D, device=dev).bfloat16()
    g = -F.softplus(torch.randn(1, a.tokens, a.value_heads, device=dev))
    beta = torch.sigmoid(torch.randn(1, a.tokens, a.value_heads, device=dev))
    pool = torch.zeros(a.seqs + 1, a.value_heads, D, D, device=dev, dtype=dtype)
    rows = torch.arange(1, a.seqs + 1, device=dev, dtype=torch.int32)
    has = torch.ones(a.seqs, dtype=torch.bool, device=dev)

    def vllm_form():
        initial = pool[rows].to(torch.float32)
        out, final = chunk_gated_delta_rule(q=q[0].contiguous(), k=k[0].contiguous(), v=v[0].contiguous(),
                                            g=torch.exp(g[0].contiguous()), beta=beta[0].contiguous(),
                                            initial_state=initial, output_final_state=True,
                                            cu_seqlens=cu.long(), backend="flashinfer")
        pool[rows] = final.to(dtype)
        return out

    def pool_form():
        return flashinfer_pool_prefill.run(q, k, v, g, beta, states=pool, state_indices=rows, has_initial_state=has,
                                           cu_seqlens=cu, exps_gate=True)

    for name, form in (("vllm", vllm_form), ("pool", pool_form), ("vllm", vllm_form), ("pool", pool_form)):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        live = torch.cuda.memory_allocated()
        out = form()
        torch.cuda.synchronize()
        del out
        print(json.dumps({"form": name, "tokens": a.tokens, "seqs": a.seqs, "key_heads": a.key_heads,
                          "value_heads": a.value_heads, "state_dtype": a.state_dtype,
                          "peak_above_live_gib": round((torch.cuda.max_memory_allocated() - live) / (1 << 30), 3),
                          "gpu": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
