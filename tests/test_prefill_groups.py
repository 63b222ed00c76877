"""A ring layer's prefill op per group of chunks (vllm.prefill_groups, issue 46).

The groups are checked on the host (every token once, in order, each group within its chunk and
sequence bounds, sequences cut only at their chunk boundaries); a grouped run against one call of
the package's float64 reference recurrence on fresh random inputs, with the step's output and
state rows poisoned first; the layer's op wrapper and the builder that draws the groups beside
vLLM's chunk metadata. Whether vLLM's FLA op gives the same bits grouped and whole, and the
memory saved, is measured on the GPU (benchmarks/gdn_prefill_groups.py).
"""

from __future__ import annotations

import os
from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F

from replayssm_patch.testing.reference_prefill import ReferencePrefill
from replayssm_patch.vllm import prefill_groups, prefill_profile

CHUNK = 64


def random_cu(gen, seqs: int, max_len: int) -> list[int]:
    lens = torch.randint(1, max_len + 1, (seqs,), generator=gen).tolist()
    return [0, *accumulate(lens)]


@pytest.mark.parametrize("seed", range(6))
def test_groups_cover_the_step_within_their_bounds(seed):
    gen = torch.Generator().manual_seed(seed)
    seqs = [1, 5, 64, 65, 200, 700][seed]
    cu = random_cu(gen, seqs, [9000, 3000, 80, 130, 40, 70][seed])
    max_chunks, max_seqs = [64, 64, 64, 8, 64, 3][seed], [64, 64, 64, 64, 16, 64][seed]
    groups = prefill_groups.split(cu, CHUNK, max_chunks, max_seqs)
    assert groups[0][0] == 0 and groups[-1][1] == cu[-1] and groups[-1][3] == seqs
    for (t0, t1, s0, s1), nxt in zip(groups, groups[1:] + [None]):
        assert t0 < t1 and s0 < s1
        if nxt is not None:
            assert nxt[0] == t1 and nxt[2] in (s1 - 1, s1)  # the next starts where this ended
            cut = nxt[2] == s1 - 1
            assert cut == (cu[s1 - 1] < t1 < cu[s1])
            if cut:  # a sequence is cut only at one of its own chunk boundaries
                assert (t1 - cu[s1 - 1]) % CHUNK == 0
        assert cu[s0] <= t0 < cu[s0 + 1] and cu[s1 - 1] < t1 <= cu[s1]
        if t0 > cu[s0]:  # a group that goes on with a cut sequence holds nothing else
            assert s1 - s0 == 1
        parts = [(max(t0, cu[s]), min(t1, cu[s + 1])) for s in range(s0, s1)]
        assert all(a < b for a, b in parts)
        assert sum(-(-(b - a) // CHUNK) for a, b in parts) <= max_chunks and s1 - s0 <= max_seqs


def test_a_step_within_one_group_is_not_grouped():
    assert prefill_groups.plan(torch.tensor([0, 4096], dtype=torch.int32), CHUNK, None) is None
    assert prefill_groups.plan(torch.tensor(list(range(65)), dtype=torch.int32), CHUNK, None) is None
    assert prefill_groups.split([0, 4097], CHUNK) == [(0, 4096, 0, 1), (4096, 4097, 0, 1)]
    assert prefill_groups.split(list(range(66)), CHUNK) == [(0, 64, 0, 64), (64, 65, 64, 65)]
    assert prefill_groups.split([0, 100, 103, 300], CHUNK, max_chunks=2) == [
        (0, 100, 0, 1), (100, 167, 1, 3), (167, 295, 2, 3), (295, 300, 2, 3)]


HK, HV, D = 1, 2, 8


def step_inputs(gen, cu: list[int], state_dtype):
    tokens, seqs = cu[-1], len(cu) - 1
    q = F.normalize(torch.randn(1, tokens, HK, D, generator=gen), dim=-1).to(torch.bfloat16)
    k = F.normalize(torch.randn(1, tokens, HK, D, generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, tokens, HV, D, generator=gen).to(torch.bfloat16)
    g = -F.softplus(torch.randn(1, tokens, HV, generator=gen))
    beta = torch.sigmoid(torch.randn(1, tokens, HV, generator=gen))
    initial = (0.3 * torch.randn(seqs, HV, D, D, generator=gen)).to(state_dtype)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial, use_qk_l2norm_in_kernel=False)


def on_device(record):
    """plan()'s to_device, on the CPU: the group's query start locations and fake chunk metadata
    naming the group (each group's must reach its own call)."""
    def to_device(cu):
        record.append(cu.clone())
        return cu, torch.full((1,), len(record)), None
    return to_device


def pool_for(gen, initial: torch.Tensor, spare: int = 7):
    """A state pool holding `initial`'s rows at random rows among `spare` others (poisoned), the
    rows' indices, and which rows hold a state (the others start from zeros)."""
    seqs = initial.shape[0]
    pool = torch.full((seqs + spare, *initial.shape[1:]), float("nan"), dtype=initial.dtype)
    rows = torch.randperm(seqs + spare, generator=gen)[:seqs]
    pool[rows] = initial
    has = torch.rand(seqs, generator=gen) < 0.7
    has[0] = False  # the first group's first sequence starts from zeros
    return pool, rows, has


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_a_grouped_step_matches_one_call_of_the_reference(state_dtype):
    gen = torch.Generator().manual_seed(461 if state_dtype == torch.float32 else 462)
    # long sequences cut across groups, short ones packed, one sequence of one token
    lens = [300, 1, 5, 130, 64, 65, 17, 250, 3, 90]
    cu = [0, *accumulate(lens)]
    args = step_inputs(gen, cu, state_dtype)
    pool, rows, has = pool_for(gen, args.pop("initial_state"))
    whole_op = ReferencePrefill()
    gathered = pool[rows]  # as vLLM gathers the step's states for one call
    gathered[~has] = 0
    o_ref, f_ref = whole_op(**args, initial_state=gathered, output_final_state=True,
                            cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    expected_pool = pool.clone()
    expected_pool[rows] = f_ref.to(state_dtype)  # and scatters its final states
    record = []
    groups = prefill_groups.plan(torch.tensor(cu, dtype=torch.int32), CHUNK, on_device(record))
    # small bounds for a small step: many groups, cuts in several sequences
    groups_small = prefill_groups.plan(torch.tensor(cu, dtype=torch.int32), CHUNK, on_device(record),
                                       max_chunks=3, max_seqs=2)
    assert groups is None and len(groups_small) > len(lens) // 2
    op = ReferencePrefill()
    pool_before = pool.clone()
    out = prefill_groups.run(op, groups_small, **args, states=pool, state_indices=rows, has_initial_state=has)
    assert len(op.calls) == len(groups_small)
    for call, grp in zip(op.calls, groups_small):  # each group's own metadata reached its call
        assert torch.equal(call["cu_seqlens"], grp.cu_seqlens) and call["chunk_indices"] is grp.chunk_indices
        assert call["q"].shape[1] == grp.tokens[1] - grp.tokens[0]
        assert call["initial_state"].shape[0] <= 2  # the group's states only
    for s in range(len(lens)):  # a sequence's first part starts from its pool row, or zeros
        call, grp = next((c, grp) for c, grp in zip(op.calls, groups_small) if grp.seqs[0] <= s < grp.seqs[1])
        want = pool_before[rows[s]] if has[s] else torch.zeros_like(pool_before[0])
        assert torch.equal(call["initial_state"][s - grp.seqs[0]], want)
    tol = dict(atol=2e-2, rtol=2e-2) if state_dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.float(), o_ref.float(), atol=2e-2, rtol=2e-2)  # bf16 outputs
    torch.testing.assert_close(pool[rows].float(), expected_pool[rows].float(), **tol)
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[rows] = False
    assert pool.dtype == state_dtype and pool[others].isnan().all()  # no other row touched
    assert out.dtype == o_ref.dtype and out.shape == o_ref.shape


def test_every_output_token_and_state_row_is_written():
    """Poisoned output and state rows: after a grouped run, none of the poison is left."""
    gen = torch.Generator().manual_seed(463)
    cu = [0, *accumulate([70, 1, 200, 9, 64])]
    args = step_inputs(gen, cu, torch.float32)
    pool, rows, _ = pool_for(gen, torch.full_like(args.pop("initial_state"), float("nan")))
    groups = prefill_groups.plan(torch.tensor(cu), CHUNK, lambda c: (c, None, None), max_chunks=2, max_seqs=2)
    no_state = torch.zeros(len(cu) - 1, dtype=torch.bool)  # every sequence starts from zeros
    out = prefill_groups.run(ReferencePrefill(), groups, **args, states=pool, state_indices=rows,
                             has_initial_state=no_state)
    assert not out.float().isnan().any() and not pool[rows].isnan().any()


class FakeOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, **kw):
        self.calls.append(kw)
        n = kw["initial_state"].shape[0]  # final states that tell the calls and their rows apart
        final = (10 * len(self.calls) + torch.arange(n, dtype=torch.float32)).view(n, 1, 1, 1)
        return torch.zeros(1, kw["q"].shape[1], HV, D), final.expand(kw["initial_state"].shape).clone()


def test_the_layers_op_runs_the_steps_groups_and_vllms_call_otherwise():
    gen = torch.Generator().manual_seed(464)
    cu = [0, 100, 300]
    args = step_inputs(gen, cu, torch.float32)
    pool, rows, has = pool_for(gen, args["initial_state"])
    split = prefill_groups.split(cu, CHUNK, max_chunks=2)
    groups = tuple(prefill_groups.PrefillGroup((t0, t1), (s0, s1), torch.tensor([0, t1 - t0]))
                   for t0, t1, s0, s1 in split)
    step = {"groups": prefill_groups.StepGroups(groups, rows, has)}
    op = FakeOp()
    wrapped = prefill_groups.GroupedPrefillOp(op, lambda: None if step["groups"] is None else (step["groups"], pool))
    vllm_rows = step["groups"].vllm_rows()  # what vLLM's layer gathers and scatters: the last sequence
    assert torch.equal(vllm_rows["prefill_state_indices"], rows[-1:])
    assert torch.equal(vllm_rows["prefill_has_initial_state"], has[-1:])
    call = args | dict(initial_state=pool[rows[-1:]], output_final_state=True, cu_seqlens=torch.tensor(cu),
                       chunk_indices="whole")
    out, last = wrapped(**call)
    assert len(op.calls) == len(groups) and all(c["chunk_indices"] is None for c in op.calls)
    assert out.shape[1] == cu[-1] and len({float(x) for x in pool[rows, 0, 0, 0]}) == len(rows)
    assert torch.equal(last, pool[rows[-1:]])  # vLLM scatters it back where the groups left it
    op.calls.clear()
    step["groups"] = None  # no groups this step: vLLM's call
    wrapped(**call)
    (c,) = op.calls
    assert c["chunk_indices"] == "whole" and c["initial_state"] is call["initial_state"]
    # groups of another call, or vLLM's own output buffer: vLLM gathered one row, no call can serve it
    for other in ({"groups": prefill_groups.StepGroups(groups[:-1], rows, has)},
                  {"groups": prefill_groups.StepGroups(groups, rows[:1], has[:1])},
                  {"core_attn_out": torch.empty(1)}):
        step["groups"] = other.get("groups", prefill_groups.StepGroups(groups, rows, has))
        with pytest.raises(RuntimeError, match="prefill groups"):
            wrapped(**call | {k: v for k, v in other.items() if k != "groups"})


def test_the_profile_step_runs_its_costliest_group_first():
    lens = prefill_profile.group_filling_lens(16384, 512, CHUNK)
    cu = [0, *accumulate(lens)]
    t0, t1, s0, s1 = prefill_groups.split(cu, CHUNK)[0]
    assert (s1 - s0, -(-(t1 - t0) // CHUNK)) == (prefill_groups.GROUP_SEQS, prefill_groups.GROUP_CHUNKS)
    for tokens, seqs in ((16384, 512), (16384, 32), (16384, 1), (20, 3), (100, 70)):
        lens = prefill_profile.group_filling_lens(tokens, seqs, CHUNK)
        assert len(lens) == seqs and sum(lens) == tokens and min(lens) >= 1
    op = ReferencePrefill()
    qkv = torch.randn(300, (2 * HK + HV) * D).to(torch.bfloat16)
    prefill_profile.prefill_step(op, qkv, (HK, HV), (HV, D, D), torch.float32, 70, CHUNK)
    assert len(op.calls) == 2 and op.calls[0]["initial_state"].shape[0] == prefill_groups.GROUP_SEQS


if not os.environ.get("CI"):
    pytest.importorskip("vllm")


def test_the_builder_draws_groups_beside_vllms_chunk_metadata(monkeypatch):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    from replayssm_patch.vllm.gdn_backend import ReplayGDNAttentionMetadataBuilder

    seen = []

    def vllm_chunk_metadata(self, cu, cu_cpu, device):  # as vLLM >= 0.33's, from the host copy
        seen.append(cu_cpu.clone())
        return torch.tensor([len(seen)]), None

    monkeypatch.setattr(GDNAttentionMetadataBuilder, "_build_chunk_metadata", vllm_chunk_metadata, raising=False)
    monkeypatch.setattr(prefill_groups, "fla_chunk_size", lambda: CHUNK)
    builder = ReplayGDNAttentionMetadataBuilder.__new__(ReplayGDNAttentionMetadataBuilder)
    cu = torch.tensor([0, 5000, 5010, 5100], dtype=torch.int32)
    for backend, platform, grouped in (("triton", "cuda", True), ("flashinfer", "cuda", False),
                                       ("triton", "cpu", False)):
        seen.clear()
        builder.gdn_prefill_backend, builder._prefill_groups = backend, None
        builder.groups_prefill = platform == "cuda"
        whole = builder._build_chunk_metadata(cu, cu, "cpu")
        assert torch.equal(whole[0], torch.tensor([1])) and torch.equal(seen[0], cu)  # vLLM's own, first
        groups = builder._prefill_groups
        if not grouped:
            assert groups is None and len(seen) == 1
            continue
        assert [(grp.tokens, grp.seqs) for grp in groups] == [((0, 4096), (0, 1)), ((4096, 5000), (0, 1)),
                                                               ((5000, 5100), (1, 3))]
        assert torch.equal(groups[2].cu_seqlens, torch.tensor([0, 10, 100], dtype=torch.int32))
        assert [grp.chunk_indices.item() for grp in groups] == [2, 3, 4]  # vLLM's, per group
        assert [s.tolist() for s in seen[1:]] == [[0, 4096], [0, 904], [0, 10, 100]]


def test_another_cache_groups_metadata_gives_the_groups_its_own_state_rows(monkeypatch):
    """vLLM's V2 runner builds one GDN cache group's metadata and re-gathers the state indices for
    the others (update_block_table): the grouped op must gather that group's rows, and vLLM's
    layer again only the last sequence's."""
    from dataclasses import dataclass, replace

    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    from replayssm_patch.vllm.gdn_backend import ReplayGDNAttentionMetadataBuilder

    @dataclass
    class Metadata:  # the fields these steps read, as vLLM's GDN metadata names them
        num_prefills: int
        num_decodes: int
        non_spec_state_indices_tensor: torch.Tensor
        has_initial_state: torch.Tensor
        prefill_state_indices: torch.Tensor
        prefill_has_initial_state: torch.Tensor
        ring_start_empty: torch.Tensor
        ring_prefill_groups: object = None
        ring_prefill_flush_slots: torch.Tensor | None = None
        ring_prefill_slots: torch.Tensor | None = None

    def vllm_update(self, m, blk_table, slot_mapping):  # as vLLM's: the other group's indices
        return replace(m, non_spec_state_indices_tensor=blk_table[:, 0],
                       prefill_state_indices=blk_table[m.num_decodes:, 0])

    monkeypatch.setattr(GDNAttentionMetadataBuilder, "update_block_table", vllm_update, raising=False)
    builder = ReplayGDNAttentionMetadataBuilder.__new__(ReplayGDNAttentionMetadataBuilder)
    groups = (prefill_groups.PrefillGroup((0, 64), (0, 2), None), prefill_groups.PrefillGroup((64, 70), (2, 3), None))
    first = torch.tensor([7, 3, 9, 4])  # one decode row, then three prefill rows
    has = torch.tensor([True, False, True, True])
    step = prefill_groups.StepGroups(groups, first[1:], has[1:])
    md = Metadata(3, 1, first, has, **step.vllm_rows(), ring_start_empty=torch.zeros(4, dtype=torch.int8),
                  ring_prefill_groups=step)
    other = torch.tensor([[11], [12], [13], [14]])
    md2 = builder.update_block_table(md, other, None)
    assert torch.equal(md2.ring_prefill_groups.state_indices, torch.tensor([12, 13, 14]))
    assert torch.equal(md2.ring_prefill_groups.has_initial_state, has[1:])
    assert md2.ring_prefill_groups.groups is groups
    assert torch.equal(md2.prefill_state_indices, torch.tensor([14]))
    assert torch.equal(md2.prefill_has_initial_state, torch.tensor([True]))
    assert torch.equal(md2.ring_prefill_slots, torch.tensor([12, 13, 14]))
    assert torch.equal(md.ring_prefill_groups.state_indices, first[1:])  # the first group's kept


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_a_cut_sequence_goes_on_from_the_state_the_op_gave(state_dtype):
    """The next part of a cut sequence starts from its first part's final state as the op returned
    it (fp32), never rounded to a 16-bit pool's dtype in between: one call keeps it in fp32."""
    gen = torch.Generator().manual_seed(465)
    cu = [0, *accumulate([100, 3, 150])]
    args = step_inputs(gen, cu, state_dtype)
    inner, finals = ReferencePrefill(), []

    def op(**kw):
        o, f = inner(**kw)
        finals.append(f)
        return o, f

    groups = prefill_groups.plan(torch.tensor(cu), CHUNK, lambda c: (c, None, None), max_chunks=2, max_seqs=8)
    pool, rows, has = pool_for(gen, args.pop("initial_state"))
    prefill_groups.run(op, groups, **args, states=pool, state_indices=rows, has_initial_state=has)
    cuts = [i for i in range(len(groups) - 1) if groups[i + 1].seqs[0] == groups[i].seqs[1] - 1]
    assert cuts
    for i in cuts:
        given = inner.calls[i + 1]["initial_state"][0]
        assert given.dtype == torch.float32 and torch.equal(given, finals[i][-1])
    # a group that goes on with no cut sequence gathers its states in the pool's dtype
    assert any(inner.calls[i + 1]["initial_state"].dtype == state_dtype
               for i in range(len(groups) - 1) if i not in cuts)
