"""A step's per-row ring flags in one launch (`_vendored/ring_flags.py`, what the metadata builder
runs on CUDA) under TRITON_INTERPRET=1 on the CPU, against the torch ops the builder runs on the
CPU (`ReplayGDNAttentionMetadataBuilder._ring_fields`).

Fresh random steps: decode rows (one token) and prefill chunks (several), some rows starting at
zero computed tokens, sequence lengths at, before and after block boundaries, int32 and int64
metadata, strided metadata views, flag buffers poisoned past `rows` (must stay untouched), align
mode with two block sizes and without it. Runs in one fresh subprocess, as
test_ring_verify_interpret.py does.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the subprocess: interpret mode before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

from replayssm_patch.testing.interpreted import interpreted_test


def _reference(qsl, seq, rows, block_size):
    import torch

    computed = seq[:rows] - (qsl[1:rows + 1] - qsl[:rows])
    if block_size is None:
        return torch.zeros(rows, dtype=torch.int8), (computed == 0).to(torch.int8)
    return ((torch.remainder(seq[:rows], block_size) == 0).to(torch.int8),
            (torch.remainder(computed, block_size) == 0).to(torch.int8))


def check_flags(seed, block_size, dtype_name="int32", device="cpu"):
    import torch

    from replayssm_patch._vendored import ring_flags

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
    seq = computed + query
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(query, 0)])
    # strided views of bigger buffers, as sliced from vLLM's persistent ones
    qsl_buf = torch.full((2 * (rows + 1 + spare),), -5, dtype=dtype)
    qsl_buf[0:2 * (rows + 1):2] = qsl.to(dtype)
    seq_buf = torch.full((rows + spare,), -3, dtype=dtype)
    seq_buf[:rows] = seq.to(dtype)
    force = torch.full((rows + spare,), 7, dtype=torch.int8)
    empty = torch.full((rows + spare,), 7, dtype=torch.int8)
    want_force, want_empty = _reference(qsl, seq, rows, block_size)
    force, empty = force.to(device), empty.to(device)
    ring_flags(qsl_buf.to(device)[::2], seq_buf.to(device), force, empty, rows, block_size)
    force, empty = force.cpu(), empty.cpu()
    assert torch.equal(force[:rows], want_force), "force_flush differs"
    assert torch.equal(empty[:rows], want_empty), "start_empty differs"
    assert (force[rows:] == 7).all() and (empty[rows:] == 7).all(), "wrote past rows"
    assert 0 < int(want_empty.sum()) < rows
    if block_size:
        assert 0 < int(want_force.sum()) < rows
    return {"rows": rows, "force": int(want_force.sum()), "empty": int(want_empty.sum())}


def case_align_block_16():
    return check_flags(1, 16)


def case_align_block_528_int64():
    return check_flags(2, 528, "int64")


def case_no_align():
    return check_flags(3, None)


def case_rejects_bad_inputs():
    import torch

    from replayssm_patch._vendored import ring_flags

    qsl, seq = torch.arange(5, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    f, e = torch.zeros(4, dtype=torch.int8), torch.zeros(4, dtype=torch.int8)
    good = dict(query_start_loc=qsl, seq_lens=seq, force_flush=f, start_empty=e, rows=4, block_size=16)
    bad = {"query_start_loc": qsl[:4], "seq_lens": seq.float(), "force_flush": f.bool(), "start_empty": e[:3],
           "block_size": 0}
    for name, value in bad.items():
        try:
            ring_flags(**(good | {name: value}))
        except ValueError as err:
            assert name in str(err), err
        else:
            raise AssertionError(f"ring_flags accepted a bad {name}")
    ring_flags(**good | {"rows": 0})  # nothing to do
    return {}


CASES = [case_align_block_16, case_align_block_528_int64, case_no_align, case_rejects_bad_inputs]


test_ring_flags_interpreted = interpreted_test(__file__, CASES)


if __name__ == "__main__":
    from replayssm_patch.testing.interpreted import run_cases

    sys.exit(run_cases(CASES, set(sys.argv[1:])))
