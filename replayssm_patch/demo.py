"""Demo: `python -m replayssm_patch.demo [--help]`.

By default it runs real vLLM (the CPU build works) on a small random-weight Qwen3.5 checkpoint
built locally, once native and once patched, each in its own process, and prints the generated
tokens' agreement, how the ring was used (decode calls, flushes, the shadow check against vLLM's
own kernel) and the cache bytes the ring adds.

With `--math` it shows the reference math alone: it decodes random Gated DeltaNet inputs two
ways, with the package's torch references:

* sequential (vLLM's native decode): read the state, update it, write it back, every token;
* ReplaySSM ring: read the checkpoint plus a small ring of replay entries, append one entry,
  and write the checkpoint only when the ring flushes (every `--ring` tokens);

then prints how far the two are from a float64 ground truth and from each other, and how many
checkpoint writes each did.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from replayssm_patch.ops.gdn_reference import recurrent_decode_reference
from replayssm_patch.ops.decode_reference import ring_decode_reference
from replayssm_patch.ops.materialize_reference import ring_materialize_reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def math_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="ReplaySSM vs sequential GDN decode (reference math, CPU)")
    p.add_argument("--batch", type=int, default=4, help="requests decoding together")
    p.add_argument("--steps", type=int, default=64, help="tokens decoded per request")
    p.add_argument("--ring", type=int, default=16, help="ring length L (checkpoint write every L tokens)")
    p.add_argument("--key-heads", type=int, default=4)
    p.add_argument("--value-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--state-dtype", choices=DTYPES, default="fp32", help="checkpoint dtype")
    p.add_argument("--act-dtype", choices=DTYPES, default="bf16", help="activation and d/k ring dtype")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    torch.manual_seed(a.seed)
    B, H, HV, K, V, L = a.batch, a.key_heads, a.value_heads, a.head_dim, a.head_dim, a.ring
    if HV % H:
        p.error("--value-heads must be a multiple of --key-heads")
    act, sdt = DTYPES[a.act_dtype], DTYPES[a.state_dtype]
    slots = B + 1  # slot 0 is vLLM's NULL block
    idx = torch.arange(1, B + 1, dtype=torch.int32)
    A_log = torch.empty(HV).uniform_(math.log(0.5), math.log(16.0))
    dt_bias = torch.randn(HV) * 0.5
    scale = K ** -0.5

    init = torch.randn(slots, HV, V, K) * 0.3
    seq_state = init.to(sdt).clone()  # .to() of the same dtype would alias `init`
    ring_state = init.to(sdt).clone()
    truth = init.to(sdt).double()
    ring_d = torch.zeros(slots, HV, L, V, dtype=act)
    ring_k = torch.zeros(slots, H, L, K, dtype=act)
    ring_g = torch.zeros(slots, HV, L, dtype=torch.float32)
    cursor = torch.zeros(slots, dtype=torch.int32)

    print(f"GDN decode, {B} requests x {a.steps} tokens; H={H} key / HV={HV} value heads, K=V={K}; "
          f"state {a.state_dtype}, activations and d/k ring {a.act_dtype}, ring length L={L}")
    width = 2 * H * K + HV * V
    err_out = {"seq": 0.0, "ring": 0.0, "ring_vs_seq": 0.0}
    writes = {"seq": 0, "ring": 0}
    t_seq = t_ring = 0.0
    for _ in range(a.steps):
        mixed = torch.randn(B, width).to(act)
        av = torch.randn(B, HV).to(act)
        bv = (torch.randn(B, HV) * 1.5).to(act)

        o_truth = torch.empty(B, HV, V, dtype=torch.float64)
        recurrent_decode_reference(mixed.double(), av.double(), bv.double(), A_log.double(),
                                   dt_bias.double(), scale, truth, o_truth, idx)

        before = seq_state.clone()
        o_seq = torch.empty(B, HV * V, dtype=act)
        t0 = time.perf_counter()
        recurrent_decode_reference(mixed, av, bv, A_log, dt_bias, scale, seq_state, o_seq, idx)
        t_seq += time.perf_counter() - t0
        writes["seq"] += sum(not torch.equal(before[s], seq_state[s]) for s in idx.tolist())

        before = ring_state.clone()
        o_ring = torch.empty(B, HV * V, dtype=act)
        t0 = time.perf_counter()
        ring_decode_reference(mixed, av, bv, A_log, dt_bias, scale, ring_state, o_ring, idx,
                              ring_d, ring_k, ring_g, cursor)
        t_ring += time.perf_counter() - t0
        writes["ring"] += sum(not torch.equal(before[s], ring_state[s]) for s in idx.tolist())

        o_seq, o_ring = o_seq.view(B, HV, V), o_ring.view(B, HV, V)
        err_out["seq"] = max(err_out["seq"], rel_err(o_seq, o_truth))
        err_out["ring"] = max(err_out["ring"], rel_err(o_ring, o_truth))
        err_out["ring_vs_seq"] = max(err_out["ring_vs_seq"], rel_err(o_ring, o_seq))

    pending = int(cursor[1:].sum())
    ring_materialize_reference(ring_state, ring_d, ring_k, ring_g, cursor, idx)
    err_state = {"seq": rel_err(seq_state[1:], truth[1:]), "ring": rel_err(ring_state[1:], truth[1:])}

    tokens = B * a.steps
    print("max relative error of outputs vs float64 truth: "
          f"sequential {err_out['seq']:.2e}, ring {err_out['ring']:.2e} "
          f"(ring vs sequential {err_out['ring_vs_seq']:.2e})")
    print("relative error of the final state vs float64 truth: "
          f"sequential {err_state['seq']:.2e}, ring {err_state['ring']:.2e} "
          f"(ring materialised with {pending} pending entries)")
    print(f"checkpoint writes over {tokens} tokens: sequential {writes['seq']} (every token), "
          f"ring {writes['ring']} (one per {L} tokens per request)")
    state_bytes = HV * V * K * torch.tensor([], dtype=sdt).element_size()
    print(f"state bytes written: sequential {writes['seq'] * state_bytes / 2**20:.1f} MiB, "
          f"ring {writes['ring'] * state_bytes / 2**20:.1f} MiB (+ ring entries, "
          f"{tokens * (HV * V + H * K) * torch.tensor([], dtype=act).element_size() / 2**20:.1f} MiB)")
    print(f"(torch reference timings, not kernels: sequential {t_seq:.2f} s, ring {t_ring:.2f} s)")
    tol = 3e-5 if sdt == act == torch.float32 else 2e-2
    ok = err_out["ring"] < tol and err_state["ring"] < tol
    print("OK: the ring form matches the sequential recurrence" if ok else
          f"MISMATCH: ring error above {tol:g}")
    return 0 if ok else 1


def vllm_main(argv: list[str] | None = None) -> int:
    import json
    import os
    import random
    import subprocess
    import sys
    import tempfile

    from replayssm_patch.testing.agreement import compare
    from replayssm_patch.testing.tiny_models import DECISIVE, build_tiny_model

    p = argparse.ArgumentParser(
        description="native vs patched vLLM on a small random-weight Qwen3.5 model. The patched arm "
                    "serves plain decode through the ring at every batch (min_batch=1): on CPU the default "
                    "keeps it native, since the CPU ring's step is vLLM's kernel plus the replay.",
        epilog="python -m replayssm_patch.demo --math [--help]: the reference math alone (no vLLM)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--ring", type=int, default=16)
    p.add_argument("--workdir", default=os.path.join(".work", "demo"))
    a = p.parse_args(argv)
    os.makedirs(a.workdir, exist_ok=True)
    # the integration tests' checkpoint: logits decisive enough that its GDN state decides the
    # tokens without near ties everywhere (plain random weights give near-flat logits)
    model = str(build_tiny_model(os.path.join(a.workdir, "models"), "qwen3_5", **DECISIVE))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(5, 60))] for _ in range(a.requests)]
    engine = dict(load_format="safetensors", dtype="bfloat16", enforce_eager=True, max_model_len=512,
                  skip_tokenizer_init=True, max_num_seqs=8, seed=0, enable_prefix_caching=True)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_GDN_REPLAYSSM_SHADOW="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CACHE_ROOT", os.path.join(os.path.abspath(a.workdir), "vllm-cache"))
    env.pop("VLLM_GDN_REPLAYSSM", None)
    results = {}
    for arm in ("native", "patched"):
        engines = [{"name": "demo", "engine": engine, "prompts": prompts, "max_tokens": [a.tokens] * a.requests}]
        if arm == "native":  # the same engine with another batch size: vLLM's own batch variance
            engines.append(dict(engines[0], name="control", engine=dict(engine, max_num_seqs=1)))
        spec = {"model": model, "patched": arm == "patched", "ring_len": a.ring, "min_batch": 1, "engines": engines}
        fd, path = tempfile.mkstemp(suffix=".json", dir=a.workdir)
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        print(f"running vLLM {arm} ({a.requests} requests x {a.tokens} tokens, model {model}) ...", flush=True)
        proc = subprocess.run([sys.executable, "-m", "replayssm_patch.testing.engine_runner", path],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print((proc.stdout + proc.stderr)[-4000:])
            return 1
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT_JSON ")][-1]
        results[arm] = json.loads(line[len("RESULT_JSON "):])
    nat, pat = results["native"]["demo"], results["patched"]["demo"]
    for i, (n, q) in enumerate(zip(nat["requests"], pat["requests"])):
        same = next((j for j, (x, y) in enumerate(zip(n["tokens"], q["tokens"])) if x != y), len(n["tokens"]))
        print(f"request {i}: first {same} of {len(n['tokens'])} greedy tokens identical; "
              f"native {n['tokens'][:8]}..., patched {q['tokens'][:8]}...")
    print("agreement (identical, or diverging only at a native top-2 gap < 0.01 with logprobs "
          f"agreeing before it): {compare(nat['requests'], pat['requests']).summary()}")
    print("for scale, native vs native with max_num_seqs=1 (vLLM's own batch-size variance): "
          f"{compare(nat['requests'], results['native']['control']['requests']).summary()}")
    c = results["patched"]["_status"]["counters"]
    print(f"ring usage in the patched engine: {c.get('decode_calls', 0)} ring decode calls over "
          f"{c.get('decode_rows', 0)} rows, {c.get('flushes', 0)} flushes (checkpoint writes); "
          f"native writes the state on every one of those rows")
    print(f"shadow check (vLLM's own CPU kernel on exact states beside the ring): worst relative "
          f"error {c.get('shadow_max_rel_err_x1e6', 0) / 1e6:.2e} over {c.get('shadow_checks', 0)} calls")
    ln, lp = nat["layers"][0], pat["layers"][0]
    print(f"cache bytes per GDN layer and slot: native {ln['content_bytes_per_slot']}, patched "
          f"{lp['content_bytes_per_slot']} (ring +{lp['content_bytes_per_slot'] - ln['content_bytes_per_slot']})")
    print("layers: " + ", ".join(f"{k}: {v}" for k, v in results["patched"]["_status"]["layers"].items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if "--math" in argv:
        return math_main([x for x in argv if x != "--math"])
    if argv[:1] != ["--help"] and argv[:1] != ["-h"]:
        print("replayssm_patch.demo: the patched arm takes plain decode through the ring at every batch "
              "(min_batch=1); --help for the options, --math for the reference math alone", flush=True)
    return vllm_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
