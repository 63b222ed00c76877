"""Per-kernel GPU time per decode step of ring decode launch forms, averaged over two full ring
cycles (torch profiler). Job 6 ran it from the repository root on the H200 with the v2 working
tree (see README.md; the streamed configs need a mode-5 ring_decode.py, e.g. commit 02ec60e's,
which is v3): `python3 6_kernel_times_profiler.py` (OUT=dir for kprof.json)."""
import collections, json, os, sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import torch
import kernel_decode as kd
from torch.profiler import profile, ProfilerActivity

out = {}
cases = [(B, HV, s) for B in (64, 512) for HV in (32,) for s in ("fp16", "fp32")]
cfgs = {
    "replay16": (16, 1, False, False, 3, 1),
    "replay16_fs3": (16, 1, False, False, 3, 1, 3),
    "replay8": (8, 1, False, False, 3, 1),
    "replay8_fs3": (8, 1, False, False, 3, 1, 3),
    "stream32_s2": (32, 1, False, False, 5, 1, 2, 8, 32),
    "stream16_s3": (16, 1, False, False, 5, 1, 3, 8, 32),
    "stream16_s3_x16": (16, 1, False, False, 5, 1, 3, 16, 32),
}
for B, HV, sname in cases:
    sdt = kd.STATE_DTYPES[sname]
    gen = torch.Generator(device="cuda").manual_seed(B)
    ly = kd.Layer(B, 16, HV, sdt, gen, native=False)
    for name, c in cfgs.items():
        for _ in range(kd.L):
            ly.ours(c)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2 * kd.L):
                ly.ours(c)
            torch.cuda.synchronize()
        per = collections.defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per[ev.name] += ev.device_time / (2 * kd.L)
        key = f"B{B}_HV{HV}_{sname}_{name}"
        out[key] = {k: round(v, 2) for k, v in per.items() if "kernel" in k}
        print(key, out[key], "total", round(sum(out[key].values()), 1), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "kprof.json"), "w"), indent=1)
