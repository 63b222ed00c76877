"""vLLM's chunked GDN prefill op over one step's sequences, called once as vLLM calls it and per
group as a ring layer calls it (replayssm_patch/vllm/prefill_groups.py, its groups and its run):
whether the groups give the same outputs and final states bit for bit, and how much memory each
way holds above its inputs.

Issue 46: the ring engine's memory profile holds one prefill step of `max_num_batched_tokens` over
up to `max_num_seqs` sequences back from the KV cache (replayssm_patch/vllm/prefill_profile.py).
Most of that step is the op's temporaries, which grow with the step's chunks and sequences. The
ring layer's groups bound them; a sequence longer than a group's room is cut at a chunk boundary
and goes on from its state in the next group.

    python benchmarks/gdn_prefill_groups.py [--tokens 16384] [--seqs 1,32,512] [--key-heads 16]
        [--value-heads 32] [--head-dim 128] [--out FILE]

Sequence lengths are random (seeded), so that sub-chunk, multi-chunk and cut sequences mix. Inputs as
vLLM's prefill gives them to the op: q and k unit vectors per head (bf16), v bf16, g (log decay)
and beta fp32, fp32 states in a pool that vLLM's way gathers and scatters for the whole step and
the groups for their own sequences. Needs vLLM's FLA op (vLLM >= 0.33), this package and a CUDA
GPU (`bash benchmarks/gpu_run.sh prefillgroups` after `install`). The op lookup and the argument
checks are gdn_prefill_memory.py's, beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from itertools import accumulate

GIB = 1 << 30


def random_lens(tokens: int, seqs: int, gen) -> list[int]:
    """`seqs` positive lengths summing to `tokens`, uneven."""
    import torch

    w = torch.rand(seqs, generator=gen, dtype=torch.float64) ** 3 + 0.02
    lens = [max(1, int(tokens * x / w.sum())) for x in w.tolist()]
    lens[-1] += tokens - sum(lens)
    while lens[-1] < 1:  # give the last one a token back from the longest
        i = max(range(seqs - 1), key=lambda j: lens[j])
        lens[i] -= 1
        lens[-1] += 1
    return lens


def measure(tokens: int, seqs: int, hk: int, hv: int, d: int) -> dict:
    import torch
    import torch.nn.functional as F
    from gdn_prefill_memory import chunk_op

    from replayssm_patch.vllm import prefill_groups

    op, dev = chunk_op(), "cuda"
    gen = torch.Generator().manual_seed(seqs)
    lens = random_lens(tokens, seqs, gen)
    starts = list(accumulate(lens, initial=0))
    cu = torch.tensor(starts, dtype=torch.int32, device=dev)
    q = F.normalize(torch.randn(1, tokens, hk, d, generator=gen), dim=-1).to(dev, torch.bfloat16)
    k = F.normalize(torch.randn(1, tokens, hk, d, generator=gen), dim=-1).to(dev, torch.bfloat16)
    v = torch.randn(1, tokens, hv, d, generator=gen).to(dev, torch.bfloat16)
    g = (-F.softplus(torch.randn(1, tokens, hv, generator=gen))).to(dev)
    beta = torch.sigmoid(torch.randn(1, tokens, hv, generator=gen)).to(dev)
    pool = (0.1 * torch.randn(seqs + 1, hv, d, d, generator=gen)).to(dev)  # the state pool (an input)
    rows = torch.randperm(seqs + 1, generator=gen)[:seqs].to(dev)
    has = torch.ones(seqs, dtype=torch.bool, device=dev)

    def above(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        return result, (torch.cuda.max_memory_allocated() - before) / GIB

    def whole(states):  # as vLLM runs the step: gather every sequence's state, one call, scatter
        init = states[rows]
        init[~has, ...] = 0
        o, f = op(q=q, k=k, v=v, g=g, beta=beta, initial_state=init, output_final_state=True,
                  cu_seqlens=cu, use_qk_l2norm_in_kernel=False)
        states[rows] = f.to(states.dtype)
        return o

    plan = prefill_groups.plan(cu.cpu(), prefill_groups.fla_chunk_size(), lambda c: (c.to(dev), None, None))
    plan = plan or (prefill_groups.PrefillGroup((0, tokens), (0, seqs), cu),)

    def grouped(states):  # as a ring layer's prefill op runs it: each group gathers and scatters its states
        return prefill_groups.run(op, plan, q=q, k=k, v=v, g=g, beta=beta, states=states, state_indices=rows,
                                  has_initial_state=has, use_qk_l2norm_in_kernel=False)

    whole(pool.clone())  # compile and tune both call shapes first
    grouped(pool.clone())
    f_whole, f_groups = pool.clone(), pool.clone()  # the pools are inputs, not the step's
    o_whole, gib_whole = above(lambda: whole(f_whole))
    o_groups, gib_groups = above(lambda: grouped(f_groups))
    return {"tokens": tokens, "seqs": seqs, "min_len": min(lens), "max_len": max(lens), "groups": len(plan),
            "cut_sequences": sum(grp.seqs[1] - grp.seqs[0] for grp in plan) - seqs,
            "outputs_identical": bool(torch.equal(o_whole, o_groups)),
            "final_states_identical": bool(torch.equal(f_whole, f_groups)),
            "output_max_abs_diff": float((o_whole.float() - o_groups.float()).abs().max()),
            "final_state_max_abs_diff": float((f_whole - f_groups).abs().max()),
            "whole_above_inputs_gib": gib_whole, "groups_above_inputs_gib": gib_groups}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seqs", default="1,32,512", help="sequence counts, comma-separated")
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--value-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default="gdn_prefill_groups.json")
    a = ap.parse_args()
    from gdn_prefill_memory import checked_seqs

    seqs = checked_seqs(ap, a)
    import torch

    from replayssm_patch.vllm import prefill_groups

    if not torch.cuda.is_available():
        raise SystemExit("gdn_prefill_groups.py needs a CUDA GPU")
    rows = []
    for n in seqs:
        rows.append(measure(a.tokens, n, a.key_heads, a.value_heads, a.head_dim))
        print(f"[prefill groups] {json.dumps(rows[-1])}", flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "gdn": {"key_heads": a.key_heads, "value_heads": a.value_heads, "head_dim": a.head_dim},
              "group_chunks": prefill_groups.GROUP_CHUNKS, "group_seqs": prefill_groups.GROUP_SEQS, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"[prefill groups] wrote {a.out}")


if __name__ == "__main__":
    main()
