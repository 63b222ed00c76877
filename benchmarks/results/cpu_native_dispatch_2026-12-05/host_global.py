"""Is the interpreter slower in the ring arm's process, and why (GC? frame hooks?)."""
import gc, json, os, sys, time, subprocess, statistics
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../.."))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

class P:
    __slots__ = ("a", "b")
    def __init__(self, a, b): self.a, self.b = a, b
def f(x): return x + 1
def calls():
    best = 1e9
    for _ in range(5):
        t = time.perf_counter(); acc = 0; objs = []
        for i in range(50_000):
            acc = f(acc); objs.append(P(i, acc)); d = {"k": i}
        best = min(best, time.perf_counter() - t)
    return best * 1e3

gc_t = [0.0, 0]
def cb(phase, info, _s=[0]):
    if phase == "start": _s[0] = time.perf_counter()
    else: gc_t[0] += time.perf_counter() - _s[0]; gc_t[1] += 1

def arm(name, model, requests, tokens):
    out = {"calls_start": calls()}
    if name == "ring":
        import replayssm_patch
        assert replayssm_patch.patch(strict=True, min_batch=1)["applied"]
    from cpu_decode_speed import make_engine
    llm, prompts = make_engine(model, 0, requests)
    out["calls_built"] = calls()
    from vllm import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    llm.generate(prompts, sp, use_tqdm=False)
    out["calls_after_gen"] = calls()
    out["gc_objects"] = len(gc.get_objects()); out["gc_frozen"] = gc.get_freeze_count()
    out["gc_threshold"] = gc.get_threshold(); out["gc_enabled"] = gc.isenabled()
    gc.callbacks.append(cb)
    llm.generate(prompts, sp, use_tqdm=False)
    out["gc_ms_during_gen"] = gc_t[0] * 1e3; out["gc_runs"] = gc_t[1]
    out["profile_fn"] = repr(sys.getprofile()); out["trace_fn"] = repr(sys.gettrace())
    import torch
    out["dynamo_eval_frame"] = repr(torch._C._dynamo.eval_frame.set_eval_frame(None)) if hasattr(torch._C, "_dynamo") else None
    out["calls_end"] = calls()
    print("RESULT_JSON " + json.dumps(out), flush=True)

if __name__ == "__main__":
    if sys.argv[1] in ("native", "ring"):
        arm(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])); sys.exit()
    from cpu_decode_speed import build_model
    model = build_model("tiny", 0)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_GDN_REPLAYSSM", None)
    for name in sys.argv[1]:
        name = "native" if name == "A" else "ring"
        p = subprocess.run([sys.executable, __file__, name, model, sys.argv[2], sys.argv[3]], env=env, capture_output=True, text=True)
        lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT_JSON")]
        print(name, lines[-1][12:] if lines else (p.stdout + p.stderr)[-3000:], flush=True)
