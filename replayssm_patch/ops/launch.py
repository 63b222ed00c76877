"""Launch selection for the ring kernels: what a launch is, the measured table, the override.

A decode launch (`DecodeLaunch`) names one of four forms and its few settings:

    fused      one kernel; program = (row, value head, block of `block_v` value rows)
    two_phase  a prep kernel per (row, key head) does the ring's O(L K) work once, the main
               kernel per (row, value head, block) streams the checkpoint tile
    replay     two-phase whose prep also folds the live ring d entries into two vectors per
               value head, so the main kernel has native decode's shape
    tma        two-phase prep, then a persistent main kernel (Gluon, Hopper, Triton 3.6) that
               keeps `stages` checkpoint tiles per program in flight as bulk tensor copies

`pdl` (two_phase, tma) lets the main kernel start while the prep kernel runs (programmatic
dependent launch, Hopper and newer); `flush_tc` (fused, two_phase) does a flushing row's
rank-n update as one tensor-core product (needs a 16-bit ring, blocks of >= 16 rows and >= 16
padded ring entries; bf16 only on a GPU, whose dots the interpreter gets wrong); `max_regs`
(tma) caps the main kernel's registers per thread (Triton's `maxnreg`), trading a few spills for
more programs per SM.

`DECODE_TABLE` is the table from the H200 launch sweeps (Triton 3.6, K = V = 128, L = 16, bf16
activations: benchmarks/results/launch_sweep_2026-12-03/; docs/kernels.md tells how it was chosen). Its rows are tried in
order and the first that matches wins; "pairs" = rows x value heads, scaled by SMs / 132. A row
whose launch has `flush_tc` matches only where the tensor-core flush can run, a tma row only
where the TMA form can (`tma_capable`; `ring_decode` also leaves it out for a checkpoint it
cannot address, `tma_fits`).

`override_launch` replaces the table's choice (and the verify kernel's launch) inside a
`with` block, for benchmarks and tests, as vLLM's fused-MoE `override_config` does.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import re

import torch

FORMS = ("fused", "two_phase", "replay", "tma")
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    form: str
    block_v: int
    num_warps: int = 1
    pdl: bool = False
    flush_tc: bool = False
    stages: int = 1  # tma only: checkpoint tiles in flight per program (1-8)
    max_regs: int = 0  # tma only: registers per thread the compiler may use (0: its choice)
    matvec_tc: bool = False  # tma only, 16-bit state: the two mat-vecs on tensor cores (decode_tma_tc)

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"DecodeLaunch.form must be one of {FORMS} (got {self.form!r})")
        if self.block_v < 8 or self.block_v & (self.block_v - 1):
            raise ValueError(f"DecodeLaunch.block_v must be a power of two >= 8 (got {self.block_v})")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"DecodeLaunch.num_warps must be 1, 2, 4 or 8 (got {self.num_warps})")
        if self.pdl and self.form not in ("two_phase", "tma"):
            raise ValueError(f"DecodeLaunch.pdl applies to the two_phase and tma forms only (got form {self.form!r})")
        if self.flush_tc and self.form not in ("fused", "two_phase"):
            raise ValueError("DecodeLaunch.flush_tc applies to the fused and two_phase forms only")
        if self.form == "tma" and not 1 <= self.stages <= 8:
            raise ValueError(f"DecodeLaunch.stages must be in [1, 8] for the tma form (got {self.stages})")
        if self.form != "tma" and self.stages != 1:
            raise ValueError(f"DecodeLaunch.stages applies to the tma form only (got form {self.form!r})")
        if self.matvec_tc and self.form != "tma":
            raise ValueError(f"DecodeLaunch.matvec_tc applies to the tma form only (got form {self.form!r})")
        if self.matvec_tc and self.block_v < 16 * self.num_warps:
            raise ValueError(f"DecodeLaunch.matvec_tc needs block_v >= 16 x num_warps (16 value rows per warp; "
                             f"got block_v={self.block_v}, num_warps={self.num_warps})")
        if self.max_regs and (self.form != "tma" or not 32 <= self.max_regs <= 255):
            raise ValueError(f"DecodeLaunch.max_regs must be 0 or in [32, 255], for the tma form only "
                             f"(got {self.max_regs} for form {self.form!r})")

    @property
    def name(self) -> str:
        """Short label for benchmark tables and command lines, e.g. 'two_phase_bv16_w1_pdl_tc',
        'tma_bv32_w4_s3', 'tma_bv32_w2_s2_r128', 'tma_bv32_w2_s3_mv'."""
        return (f"{self.form}_bv{self.block_v}_w{self.num_warps}" + ("_pdl" if self.pdl else "")
                + ("_tc" if self.flush_tc else "") + (f"_s{self.stages}" if self.form == "tma" else "")
                + (f"_r{self.max_regs}" if self.max_regs else "") + ("_mv" if self.matvec_tc else ""))

    @classmethod
    def from_name(cls, name: str) -> "DecodeLaunch":
        """The launch a `name` labels (benchmarks take launches on the command line this way)."""
        m = re.fullmatch(r"(fused|two_phase|replay|tma)_bv(\d+)_w(\d+)(_pdl)?(_tc)?(?:_s(\d+))?(?:_r(\d+))?(_mv)?",
                         name)
        if m is None:
            raise ValueError(f"not a launch name: {name!r} (form_bvN_wM[_pdl][_tc][_sS][_rR][_mv], form one of "
                             f"{FORMS})")
        return cls(m[1], int(m[2]), int(m[3]), pdl=bool(m[4]), flush_tc=bool(m[5]),
                   stages=int(m[6]) if m[6] else 1, max_regs=int(m[7]) if m[7] else 0, matvec_tc=bool(m[8]))


@dataclasses.dataclass(frozen=True)
class VerifyLaunch:
    """The speculative verify kernel's main launch: value rows per program, warps per program.
    Default: one warp per 32 value rows, the fastest of 8 launches at the three cells swept on
    an H200 (benchmarks/results/kernel_spec_sweep.md)."""
    block_v: int = 32
    num_warps: int = 1

    def __post_init__(self):
        if self.block_v < 8 or self.block_v & (self.block_v - 1):
            raise ValueError(f"VerifyLaunch.block_v must be a power of two >= 8 (got {self.block_v})")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"VerifyLaunch.num_warps must be 1, 2, 4 or 8 (got {self.num_warps})")


@dataclasses.dataclass(frozen=True)
class TableRow:
    state: str        # "any", "fp32" or "16-bit": the checkpoint dtype the row applies to
    ring: str         # the same, for the ring's d / k entries
    min_pairs: float  # the row applies for min_pairs <= pairs < below
    below: float
    launch: DecodeLaunch


def _fused(bv, tc=False):
    return DecodeLaunch("fused", bv, flush_tc=tc)


def _two_phase(bv, pdl=False, tc=False):
    return DecodeLaunch("two_phase", bv, pdl=pdl, flush_tc=tc)


def _tma(bv, w, stages, pdl=False, regs=0, mv=False):
    return DecodeLaunch("tma", bv, w, pdl=pdl, stages=stages, max_regs=regs, matvec_tc=mv)


_INF = math.inf
DECODE_TABLE = (
    # Hopper: the persistent TMA form (its rows match only where it can run). One stage per
    # program wins from 512 pairs: more programs per SM hide the per-tile small loads that
    # bind this kernel (Nsight Compute: long-scoreboard stalls), where more stages only add
    # copies in flight. fp32 state: bv16_w2_s1 at least as fast as the previous picks (bv32_w4_s2,
    # bv32_w4_s1_r96) up to 16384 pairs, bv32_w4_s2 above (benchmarks/results/launch_sweep_2026-12-03/).
    TableRow("fp32", "any", 16384, _INF, _tma(32, 4, 2)),
    TableRow("fp32", "any", 512, 16384, _tma(16, 2, 1)),
    # A 16-bit state with a 16-bit ring: the tensor-core mat-vecs (_mv), one stage, from 1024
    # pairs, ahead of the two- and three-stage _mv launches and tma_bv32_w4_pdl_s1 (below 1024
    # pairs tma_bv32_w4_pdl_s1 stays ahead; benchmarks/results/launch_sweep_2026-12-03/).
    TableRow("16-bit", "16-bit", 4096, _INF, _tma(64, 2, 1, mv=True)),
    TableRow("16-bit", "16-bit", 1024, 4096, _tma(32, 1, 1, mv=True)),
    TableRow("16-bit", "any", 2048, 8192, _tma(32, 2, 2, regs=168)),
    TableRow("16-bit", "any", 512, 2048, _tma(32, 4, 1, pdl=True)),
    # Large launches: the replay-vector form's main kernel runs at 62-82% of DRAM bandwidth
    # where two_phase's runs at 54-77%, which pays for its slower prep only at large batch;
    # with fp32 ring entries its prep reads twice the bytes and two_phase stays.
    TableRow("16-bit", "any", 8192, _INF, DecodeLaunch("replay", 16)),
    TableRow("fp32", "16-bit", 8192, _INF, DecodeLaunch("replay", 8)),
    # Below 1024 pairs a flushing row's rank-n update is on the critical path: with a 16-bit
    # ring it runs on tensor cores (1-10% faster there, no gain above).
    TableRow("any", "any", 512, 1024, _two_phase(16, pdl=True, tc=True)),
    TableRow("any", "any", 512, _INF, _two_phase(8)),
    # Small launches are latency-bound: one fused kernel, small tiles.
    TableRow("any", "any", 0, 65, _fused(16, tc=True)),
    TableRow("fp32", "any", 0, 129, _fused(16, tc=True)),
    TableRow("16-bit", "any", 129, 512, _two_phase(32, pdl=True, tc=True)),
    TableRow("any", "any", 0, 33, _fused(8)),
    TableRow("fp32", "any", 0, 65, _fused(16)),
    TableRow("any", "any", 0, 512, _fused(32)),
)

_decode_override: contextvars.ContextVar[DecodeLaunch | None] = contextvars.ContextVar("decode_launch", default=None)
_verify_override: contextvars.ContextVar[VerifyLaunch | None] = contextvars.ContextVar("verify_launch", default=None)


@contextlib.contextmanager
def override_launch(decode: DecodeLaunch | None = None, verify: VerifyLaunch | None = None):
    """Inside the block, ring_decode launches `decode` and ring_verify `verify` instead of what
    the table picks; None leaves that kernel's launch as it was (an enclosing block's, or the
    table's)."""
    tokens = []
    try:
        for name, value, kind, var in (("decode", decode, DecodeLaunch, _decode_override),
                                       ("verify", verify, VerifyLaunch, _verify_override)):
            if value is None:
                continue
            if not isinstance(value, kind):
                raise TypeError(f"override_launch({name}=...) takes a {kind.__name__} (got {type(value).__name__})")
            tokens.append((var, var.set(value)))
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1); triton.next_power_of_2 without its
    constexpr-function wrapper, which costs microseconds of host time per call."""
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # the interpreter on CPU: any plausible value


def flush_tc_supported(ring_dtype: torch.dtype, L: int, device: torch.device) -> bool:
    """Whether the tensor-core flush can run: 16-bit ring entries (the keys enter the product
    exactly), >= 16 padded ring entries (tl.dot's smallest K); bf16 only on a GPU (Triton's
    interpreter computes bf16 dots wrongly, fp16 ones right)."""
    return (ring_dtype in _SIXTEEN_BIT and next_pow2(L) >= 16
            and (device.type == "cuda" or ring_dtype == torch.float16))


def _kind(dtype: torch.dtype) -> str:
    return "16-bit" if dtype in _SIXTEEN_BIT else "fp32"


# Triton releases the Gluon kernel is written and GPU-tested against: Gluon's API moves between
# releases (3.9 removed `tma.async_copy_global_to_shared`), so other releases keep the Triton forms.
GLUON_TRITON_RELEASES = ("3.6.",)


def gluon_release_ok(version: str) -> bool:
    return version.startswith(GLUON_TRITON_RELEASES)


@functools.lru_cache(maxsize=None)
def tma_capable(device: torch.device) -> bool:
    """Whether the TMA form can run on `device`: a Hopper GPU (capability 9.x: bulk tensor
    copies; the only architecture it was measured on) and a Triton release whose Gluon it is
    written for."""
    if (device.type != "cuda" or not torch.cuda.is_available()
            or torch.cuda.get_device_capability(device)[0] != 9):
        return False
    import triton

    return gluon_release_ok(triton.__version__)


def tma_fits(state: torch.Tensor, K: int, V: int, block_v: int, slot_stride: int) -> bool:
    """Whether the TMA form can address this checkpoint: K a power of two in [16, 256], V a
    multiple of block_v (<= 256), 16-byte aligned base, slot stride and rows."""
    e = state.element_size()
    return (K & (K - 1) == 0 and 16 <= K <= 256 and V % block_v == 0 and block_v <= 256
            and state.data_ptr() % 16 == 0 and (slot_stride * e) % 16 == 0 and (K * e) % 16 == 0)


def pick_decode_launch(rows: int, HV: int, state_dtype: torch.dtype, ring_dtype: torch.dtype, L: int,
                       device, tma: bool | None = None) -> DecodeLaunch:
    """The table's launch for `rows` decode rows of HV value heads (the first matching row).
    `tma`: whether rows of the TMA form may match (default: where the device can run it)."""
    device = torch.device(device)
    pairs = rows * HV * 132.0 / num_sms(device)
    tc = flush_tc_supported(ring_dtype, L, device)
    if tma is None:
        tma = tma_capable(device)
    for r in DECODE_TABLE:
        if (r.state in ("any", _kind(state_dtype)) and r.ring in ("any", _kind(ring_dtype))
                and r.min_pairs <= pairs < r.below and (tc or not r.launch.flush_tc)
                and (tma or r.launch.form != "tma")):
            return r.launch
    raise AssertionError(f"DECODE_TABLE has no row for {pairs} pairs")  # its last row covers < 512


def decode_launch(rows, HV, state_dtype, ring_dtype, L, device: torch.device, tma: bool = True) -> DecodeLaunch:
    """The override in force, else the table's pick (cached: this runs per layer and step);
    tma=False: a pick without the TMA form (a checkpoint it cannot address)."""
    forced = _decode_override.get()
    if forced is not None:
        return forced
    return _cached_pick(rows, HV, state_dtype, ring_dtype, L, device, num_sms(device), tma)


@functools.lru_cache(maxsize=4096)
def _cached_pick(rows, HV, state_dtype, ring_dtype, L, device, sms, tma) -> DecodeLaunch:
    return pick_decode_launch(rows, HV, state_dtype, ring_dtype, L, device,  # sms: part of the key
                              tma=tma and tma_capable(device))


def verify_launch() -> VerifyLaunch:
    forced = _verify_override.get()
    return forced if forced is not None else VerifyLaunch()


_PROGRAMS_PER_SM: dict = {}  # kernel specialisation -> programs that fit on one SM at once


def programs_per_sm(kernel, kernel_args, constexprs: dict, device: torch.device) -> int:
    """How many programs of this specialisation of a persistent `kernel` one SM holds at once
    (registers, shared memory, threads), from the compiled kernel: a larger grid runs in waves."""
    key = (kernel, device, tuple(getattr(a, "dtype", None) for a in kernel_args[:12]), tuple(constexprs.items()))
    per_sm = _PROGRAMS_PER_SM.get(key)
    if per_sm is None:
        k = kernel.warmup(*kernel_args, grid=(1,), **constexprs)
        k._init_handles()  # loads the binary, which reports its register count (Triton 3.6's API)
        warps = constexprs["num_warps"]
        regs = cdiv(k.n_regs * 32, 256) * 256 * warps  # allocated per warp in units of 256
        from triton.runtime import driver  # the CUDA driver: only where a persistent kernel launches

        props = driver.active.utils.get_device_properties(
            device.index if device.index is not None else torch.cuda.current_device())
        smem = props["max_shared_mem"] + 1024  # the SM's shared memory; 1 KB is reserved per program
        per_sm = max(1, min(smem // (k.metadata.shared + 1024), props["max_num_regs"] // regs, 64 // warps, 32))
        _PROGRAMS_PER_SM[key] = per_sm
    return per_sm
