"""A step's per-row ring flags in one launch (`ops/ring_flags.py`, what the metadata builder
runs on CUDA) under TRITON_INTERPRET=1 on the CPU, against the torch ops the builder runs on the
CPU (`ring.flags.fill_flags` on CPU tensors), and a hand check of the formulas.

Fresh random steps: decode rows (one token) and prefill chunks (several), some rows starting at
zero computed tokens, sequence lengths at, before and after block boundaries, padding rows (no
tokens, length 0), int32 and int64 metadata, contiguous (as vLLM's) and strided metadata views,
flag buffers poisoned past `rows` (must stay untouched), align mode with two block sizes and
without it. Runs in one fresh subprocess, as test_ring_verify_interpret.py does.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the subprocess: interpret mode before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

from replayssm_patch.testing.interpreted import interpreted_test


def check_flags(seed, block_size, dtype_name="int32", strided=False, device="cpu"):
    import torch

    from replayssm_patch.ops import ring_flags
    from replayssm_patch.ring.flags import fill_flags

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    rows, spare = 300, 9  # more rows than one program's block
    bs = block_size or 16
    query = torch.where(torch.rand(rows, generator=gen) < 0.7, 1, torch.randint(2, 3 * bs, (rows,), generator=gen))
    computed = torch.randint(0, 4 * bs, (rows,), generator=gen)
    computed[::7] = 0  # rows with no prior state
    at_edge = torch.randint(1, 4, (rows,), generator=gen) * bs
    computed[1::5] = at_edge[1::5]  # starting exactly at a block boundary
    computed[2::5] = (at_edge - query).clamp_min(0)[2::5]  # ending exactly at one
    query[-3:], computed[-3:] = 0, 0  # padding rows, as vLLM pads a batch
    seq = computed + query
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(query, 0)])
    # views of bigger buffers, as sliced from vLLM's persistent ones (strided: every other entry)
    step = 2 if strided else 1
    qsl_buf = torch.full((step * (rows + 1 + spare),), -5, dtype=dtype)
    qsl_buf[0:step * (rows + 1):step] = qsl.to(dtype)
    seq_buf = torch.full((step * (rows + spare),), -3, dtype=dtype)
    seq_buf[0:step * rows:step] = seq.to(dtype)
    qsl_view, seq_view = qsl_buf[::step][:rows + 1], seq_buf[::step][:rows]
    want_force = torch.full((rows + spare,), 7, dtype=torch.int8)
    want_empty = torch.full((rows + spare,), 7, dtype=torch.int8)
    fill_flags(qsl_view, seq_view, want_force, want_empty, rows, block_size)  # the builder's CPU ops
    # the formulas by hand, for the rows the draw made sure of
    assert (want_empty[:rows][computed == 0] == 1).all() and (want_force[rows:] == 7).all()
    if block_size:
        assert (want_force[:rows][seq % block_size == 0] == 1).all()
        assert (want_empty[:rows][(computed % block_size != 0)] == 0).all()
    else:
        assert (want_force[:rows] == 0).all() and (want_empty[:rows][computed != 0] == 0).all()
    force = torch.full((rows + spare,), 7, dtype=torch.int8, device=device)
    empty = torch.full((rows + spare,), 7, dtype=torch.int8, device=device)
    ring_flags(qsl_buf.to(device)[::step][:rows + 1], seq_buf.to(device)[::step][:rows], force, empty, rows,
               block_size)
    force, empty = force.cpu(), empty.cpu()
    assert torch.equal(force, want_force), "force_flush differs"
    assert torch.equal(empty, want_empty), "start_empty differs (or a row past `rows` was written)"
    assert 0 < int(want_empty[:rows].sum()) < rows
    if block_size:
        assert 0 < int(want_force[:rows].sum()) < rows
    return {"rows": rows, "force": int(want_force[:rows].sum()), "empty": int(want_empty[:rows].sum())}


def case_align_block_16():
    return check_flags(1, 16)


def case_align_block_528_int64_strided():
    return check_flags(2, 528, "int64", strided=True)


def case_no_align():
    return check_flags(3, None)


def case_no_align_strided():
    return check_flags(4, None, strided=True)


def case_rejects_bad_inputs():
    import torch

    from replayssm_patch.ops import ring_flags
    from replayssm_patch.testing.interpreted import refuses

    qsl, seq = torch.arange(5, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    f, e = torch.zeros(4, dtype=torch.int8), torch.zeros(4, dtype=torch.int8)
    good = dict(query_start_loc=qsl, seq_lens=seq, force_flush=f, start_empty=e, rows=4, block_size=16)
    refuses(ring_flags, good, {"query_start_loc": qsl[:4], "seq_lens": seq.float(), "force_flush": f.bool(),
                               "start_empty": e[:3], "block_size": 0})
    ring_flags(**good | {"rows": 0})  # nothing to do
    return {}


CASES = [case_align_block_16, case_align_block_528_int64_strided, case_no_align, case_no_align_strided,
         case_rejects_bad_inputs]


test_ring_flags_interpreted = interpreted_test(__file__, CASES)


if __name__ == "__main__":
    from replayssm_patch.testing.interpreted import run_cases

    sys.exit(run_cases(CASES, set(sys.argv[1:])))
