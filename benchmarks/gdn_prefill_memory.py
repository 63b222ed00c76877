"""vLLM's chunked GDN prefill alone on a CUDA GPU: how much memory its temporaries take above
what the layer holds before its core, for one prefill step of `--tokens` tokens over N sequences.
vLLM's memory profile does not see this part of a serving step: its dummy run has no attention
metadata, so the GDN core only warms its kernels on 64 tokens (vllm-project/vllm#54775). Issue 46:
what an engine holds while serving beyond the memory it accounted.

Per N, the step a ring layer adds to vLLM's memory profile (`replayssm_patch.vllm.prefill_profile`),
which makes the allocations of vLLM's GDN prefill step (`_forward_core`, vLLM 0.33/0.34, Triton
prefill): the layer's input (the in-projection's q/k/v part) exists first (the profile sees it);
then, measured, the causal conv's output, q/k/v/g/beta split from it, the N states gathered,
`chunk_gated_delta_rule` with those initial states (vLLM's FLA op), the final states converted to
be scattered back. Sequence lengths are even (`--tokens` // N); many short sequences are the worst
case (each costs at least one chunk of the scan's per-chunk states, and one gathered and one final
state). `--grouped`: the step as a ring layer runs it on vLLM >= 0.33 (replayssm_patch.vllm.
prefill_groups: the op per group of chunks, each group gathering and scattering its own states), with the lengths
that make its first group the costliest a group may be.

    python benchmarks/gdn_prefill_memory.py [--tokens 16384] [--seqs 1,32,128,256,512]
        [--key-heads 16] [--value-heads 32] [--head-dim 128] [--state-dtype float32] [--grouped] [--out FILE]

The defaults are the GDN layer of the benchmarks' 9B, 4B and MoE shapes (e2e_decode.py), tensor
parallelism 1 (divide the heads by TP for a rank). Needs vLLM (>= 0.33) and a CUDA GPU
(`bash benchmarks/gpu_run.sh prefillmem`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

GIB = 1 << 30


def chunk_op():
    try:  # vLLM >= 0.33
        from vllm.third_party.flash_linear_attention.ops import chunk_gated_delta_rule
    except ImportError:
        from vllm.model_executor.layers.fla.ops import chunk_gated_delta_rule
    return chunk_gated_delta_rule


def measure(tokens: int, seqs: int, hk: int, hv: int, d: int, state_dtype: str, grouped: bool) -> dict:
    import torch

    from replayssm_patch.vllm import prefill_groups
    from replayssm_patch.vllm.prefill_profile import group_filling_lens, prefill_step, seq_lens

    dev = "cuda"
    gen = torch.Generator(dev).manual_seed(seqs)
    qkv_in = torch.randn(tokens, (2 * hk + hv) * d, device=dev, dtype=torch.bfloat16, generator=gen)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    chunk = prefill_groups.fla_chunk_size() if grouped else None
    prefill_step(chunk_op(), qkv_in, (hk, hv), (hv, d, d), getattr(torch, state_dtype), seqs, chunk)
    torch.cuda.synchronize()
    above = torch.cuda.max_memory_allocated() - before
    del qkv_in
    torch.cuda.empty_cache()
    lens = group_filling_lens(tokens, seqs, chunk) if grouped else seq_lens(tokens, seqs)
    return {"seqs": seqs, "tokens": tokens, "min_len": min(lens), "peak_above_inputs_gib": above / GIB,
            "per_token_kib": above / tokens / 1024}


def checked_seqs(ap: argparse.ArgumentParser, args) -> list[int]:
    """The sequence counts of `--seqs`, with `--seqs` and the head counts checked (`ap.error` names
    what is wrong)."""
    try:
        seqs = [int(x) for x in args.seqs.split(",")]
        assert seqs and all(0 < n <= args.tokens for n in seqs)
    except (ValueError, AssertionError):
        ap.error(f"--seqs: positive sequence counts up to --tokens, comma-separated (got {args.seqs!r})")
    if args.value_heads % args.key_heads:
        ap.error(f"--value-heads {args.value_heads} must be a multiple of --key-heads {args.key_heads}")
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of the prefill step (vLLM's max_num_batched_tokens)")
    ap.add_argument("--seqs", default="1,32,128,256,512", help="sequence counts to measure, comma-separated")
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--value-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--state-dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--grouped", action="store_true",
                    help="the step as a ring layer runs it, per group (prefill_groups), its costliest group first")
    ap.add_argument("--out", default="gdn_prefill_memory.json")
    args = ap.parse_args()
    seqs = checked_seqs(ap, args)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gdn_prefill_memory.py needs a CUDA GPU")
    import vllm

    hk, hv, d = args.key_heads, args.value_heads, args.head_dim
    measure(64, 1, hk, hv, d, args.state_dtype, args.grouped)  # the autotuner's first tries (and their buffers) first
    rows = []
    for n in seqs:
        rows.append(measure(args.tokens, n, hk, hv, d, args.state_dtype, args.grouped))
        r = rows[-1]
        print(f"[prefill memory] {args.tokens} tokens over {n} sequences (>= {r['min_len']} tokens each): "
              f"{r['peak_above_inputs_gib']:.3f} GiB above the inputs ({r['per_token_kib']:.1f} KiB per token)",
              flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(0),
              "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
              "gdn": {"key_heads": hk, "value_heads": hv, "head_dim": d, "state_dtype": args.state_dtype},
              "grouped": args.grouped,
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"[prefill memory] wrote {args.out}")


if __name__ == "__main__":
    main()
