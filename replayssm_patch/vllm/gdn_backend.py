"""The ring's GDN attention backend (returned by the ring layer's get_attn_backend): its
KV-cache spec, metadata, builder and backend class.

The layer's spec (`RingMambaSpec`) carries the plan to the builder. The builder runs vLLM's own
GDN builder, then adds per-row ring flags computed on the device from `seq_lens` and
`query_start_loc` (exact under async scheduling, no host sync; ring.flags says what they mean).

The flags live in persistent buffers, so FULL CUDA graphs replay with fresh values. It also
decides, once per step, whether the step's plain decode rows go through the ring at all
(`ring_decode`, from the plan's `min_batch`); a FULL CUDA graph keeps the decision taken for its
batch size when it was captured.

With speculative decoding (MTP) each request has one state slot (the layer asks for
`num_speculative_blocks=0`); the verify window lives in the ring as a pending window until
the next step commits it from vLLM's `num_accepted_tokens`. The builder then also passes,
for the non-speculative rows (prefills, and plain decodes where a vLLM version makes them),
their slots and accepted counts, so their windows are committed before anything reads the
slot (`ring_commit_slots` / `ring_commit_accepted`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from vllm.v1.attention.backends.gdn_attn import (
    GDNAttentionBackend,
    GDNAttentionMetadata,
    GDNAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import MambaSpec

from .. import versions, worker_counters
from ..ring.flags import fill_flags
from ..state import STATE
from . import flashinfer_pool_prefill, metadata_reuse, prefill_groups

STATS_LOG_SECONDS = 60  # the ring's counters in the worker's log, at most this often


@dataclass(frozen=True)
class RingMambaSpec(MambaSpec):
    """vLLM's GDN cache spec with the ring's tensors appended to its page, carrying the plan to
    the builder (vLLM finds a spec's cache manager through its base classes)."""

    ring_plan: object = None  # the layers' replayssm_patch.plan.Plan


def state_offsets(sizes: list[int], alignment: int = 1) -> list[int]:
    """Where each of a page's states starts, given their sizes in bytes, as vLLM packs them
    (MambaBase.bind_kv_cache): one after the other, each taking its size rounded up to
    `alignment` (the layer's state_alignment, vLLM >= 0.34; 1 before), as the page's content
    size counts them (MambaSpec.state_content_size_bytes)."""
    starts, offset = [], 0
    for size in sizes:
        starts.append(offset)
        offset += -(-size // alignment) * alignment
    return starts


def ring_spec(spec: MambaSpec, plan) -> RingMambaSpec:
    """`spec` with the ring's tensors and the plan; with MTP one checkpoint slot per request
    instead of 1+T (the verify window lives in the ring)."""
    g = plan.geometry
    extra = {"num_speculative_blocks": 0} if plan.spec_tokens else {}
    fields_ = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
    fields_.update(shapes=tuple(spec.shapes) + g.shapes, dtypes=tuple(spec.dtypes) + g.dtypes, ring_plan=plan, **extra)
    return RingMambaSpec(**fields_)


@dataclass
class ReplayGDNAttentionMetadata(GDNAttentionMetadata):
    ring_force_flush: torch.Tensor | None = None  # int8 [rows]: flush after this token
    ring_start_empty: torch.Tensor | None = None  # int8 [rows]: ignore the slot's cursor
    ring_prefill_flush_slots: torch.Tensor | None = None  # prefill slots to materialise first
    ring_prefill_slots: torch.Tensor | None = None  # prefill (and checkpoint) slots: rings empty after
    ring_commit_slots: torch.Tensor | None = None  # MTP: non-spec rows' slots, commit first
    ring_commit_accepted: torch.Tensor | None = None  # MTP: their num_accepted_tokens
    ring_decode: bool = True  # this step's plain decode rows go through the ring (else native)
    # prefill_groups.StepGroups of the prefill (groups empty: FlashInfer's op on the pool), or None
    ring_prefill_groups: object | None = None


class ReplayGDNAttentionMetadataBuilder(GDNAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        plan = kv_cache_spec.ring_plan
        rows = max(vllm_config.scheduler_config.max_num_seqs, self.decode_cudagraph_max_bs) + 1
        self.ring_force_flush = torch.zeros(rows, dtype=torch.int8, device=device)
        self.ring_start_empty = torch.zeros(rows, dtype=torch.int8, device=device)
        self.align = vllm_config.cache_config.mamba_cache_mode == "align"
        self.pool_prefill = flashinfer_pool_prefill.applies(  # as the ring layers (gdn_layer._pool_prefill)
            plan.platform, getattr(self, "gdn_prefill_backend", None), versions.installed_base_version(), self.align)
        self.block_size = kv_cache_spec.block_size
        self.min_batch = plan.min_batch
        self._last_ring_decode: bool | None = None  # the previous decode step's dispatch (counters)
        self._prefill_groups = None  # this build's: from _build_chunk_metadata, or () for the pool form (build)
        self.groups_prefill = plan.platform == "cuda"  # as the ring layers (gdn_layer._groups_prefill)
        metadata_reuse.opt_in(self, vllm_config, device)
        STATE.publish_stats_in_background(worker_counters.PUBLISH_SECONDS)  # once per worker process

    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None, fast_build=False):
        self._prefill_groups = None
        md = super().build(common_prefix_len, common_attn_metadata, num_accepted_tokens,
                           num_decode_draft_tokens_cpu, fast_build)
        STATE.log_stats_every(STATS_LOG_SECONDS)
        extra = self._ring_fields(common_attn_metadata, md)
        if self.pool_prefill and md.num_prefills:
            self._prefill_groups = ()
        if self._prefill_groups is not None:  # the layers' op gathers and scatters the states (or runs on the pool)
            step = prefill_groups.StepGroups(self._prefill_groups, md.prefill_state_indices, md.prefill_has_initial_state)
            extra["ring_prefill_groups"] = step
            extra.update(step.vllm_rows())
        extra["ring_decode"] = bool(self.num_spec) or md.num_decodes >= self.min_batch
        if md.num_decodes:
            self._count_switch(extra["ring_decode"])
        if self.num_spec:
            extra.update(self._spec_fields(common_attn_metadata, md, num_accepted_tokens,
                                           num_decode_draft_tokens_cpu))
        elif md.num_spec_decodes:  # cannot happen: spec rows exist only with a speculative config
            raise RuntimeError("GDN ring builder: speculative rows without a speculative config")
        return ReplayGDNAttentionMetadata(**({f.name: getattr(md, f.name) for f in fields(md)} | extra))

    def _build_chunk_metadata(self, prefill_query_start_loc, prefill_query_start_loc_cpu, device):
        """vLLM's chunk metadata for the step's prefill (vLLM >= 0.33 calls this from build), and,
        with the Triton (FLA) prefill op, the step's groups for the ring layers' prefill op
        (prefill_groups), each with its own chunk metadata from vLLM's same function."""
        whole = super()._build_chunk_metadata(prefill_query_start_loc, prefill_query_start_loc_cpu, device)
        if self.groups_prefill and self.gdn_prefill_backend == "triton":
            from vllm.utils.torch_utils import async_tensor_h2d  # what vLLM's chunk metadata goes to the GPU with

            def to_device(cu):
                return (async_tensor_h2d(cu, device=device),
                        *super(ReplayGDNAttentionMetadataBuilder, self)._build_chunk_metadata(None, cu, device))

            self._prefill_groups = prefill_groups.plan(prefill_query_start_loc_cpu, prefill_groups.fla_chunk_size(),
                                                       to_device)
        return whole

    def _count_switch(self, ring_decode: bool) -> None:
        """Count the dispatch's switches between decode steps (status() counters)."""
        last = self._last_ring_decode
        if last is not None and last != ring_decode:
            STATE.stats["dispatch_to_ring" if ring_decode else "dispatch_to_native"] += 1
        self._last_ring_decode = ring_decode

    def _spec_fields(self, m, md, num_accepted_tokens, draft_tokens_cpu) -> dict:
        out = {}
        rows = m.num_reqs
        if md.num_spec_decodes:
            # vLLM gathers block_table[:, :T+1] for the spec rows; with one slot per request
            # that is one column. Keep the width T+1 with the slot repeated: vLLM's CUDA conv
            # update takes the width as the window length, and only column 0 is ever used as
            # a slot (the ring's verify reads it; vLLM's conv reads it).
            idx = md.spec_state_indices_tensor
            if idx is not None and idx.shape[-1] != self.num_spec + 1:
                md.spec_state_indices_tensor = idx[:, :1].expand(-1, self.num_spec + 1)
            spec_rows = (draft_tokens_cpu[:rows] >= 0)
        else:
            spec_rows = torch.zeros(rows, dtype=torch.bool)
        ns = (~spec_rows).nonzero().flatten()
        if ns.numel() == 0 or md.non_spec_state_indices_tensor is None:
            return out
        # Non-spec rows (batch order, as vLLM orders non_spec_state_indices_tensor): commit the
        # window a previous speculative step may have left in their slot.
        slots = md.non_spec_state_indices_tensor[: ns.numel()]
        if num_accepted_tokens is None:
            acc = None
        else:
            acc = num_accepted_tokens[ns.to(num_accepted_tokens.device)]
        out["ring_commit_slots"] = slots
        out["ring_commit_accepted"] = acc
        if md.num_prefills and md.num_spec_decodes:
            # The prefill rows of a batch with spec rows are the non-spec rows (vLLM turns plain
            # decodes into prefills there); `empty` is per batch row, has_initial_state per
            # non-spec row.
            empty = self.ring_start_empty[:rows][ns.to(self.ring_start_empty.device)]
            n_p = md.num_prefills
            has_state = md.has_initial_state[:n_p]
            carries = has_state & (empty[:n_p] == 0)
            pslots = slots[:n_p]
            out["ring_prefill_flush_slots"] = torch.where(carries, pslots, torch.zeros_like(pslots))
            out["ring_prefill_slots"] = with_checkpoint_slots(pslots, md)
        return out

    def _ring_fields(self, m, md) -> dict:
        rows = m.num_reqs
        qsl = m.query_start_loc[: rows + 1]
        seq = m.seq_lens[:rows]  # tokens computed after this step
        fill_flags(qsl, seq, self.ring_force_flush, self.ring_start_empty, rows, self.block_size if self.align else None)
        out = {"ring_force_flush": self.ring_force_flush, "ring_start_empty": self.ring_start_empty}
        if md.num_spec_decodes == 0:
            out.update(self._prefill_slots(md, self.ring_start_empty[:rows]))
        return out

    @staticmethod
    def _prefill_slots(md, empty) -> dict:
        """This group's prefill slots (non-speculative batches): all of them, and those whose
        ring must be flushed before the chunk kernel reads their checkpoint."""
        if md.num_prefills == 0:
            return {"ring_prefill_flush_slots": None, "ring_prefill_slots": None}
        nd, n_p = md.num_decodes, md.num_prefills
        slots = md.non_spec_state_indices_tensor[nd : nd + n_p]
        carries_ring = md.has_initial_state[nd : nd + n_p] & (empty[nd : nd + n_p] == 0)
        return {"ring_prefill_flush_slots": torch.where(carries_ring, slots, torch.zeros_like(slots)),
                "ring_prefill_slots": with_checkpoint_slots(slots, md)}

    def update_block_table(self, metadata, blk_table, slot_mapping):
        """Another KV-cache group's metadata from this step's first (vLLM's V2 runner): vLLM
        re-gathers the state indices (all the prefill's: the grouped op's take them, vLLM's layer
        again only the last); the ring flags are batch-level and stay shared."""
        md = super().update_block_table(metadata, blk_table, slot_mapping)
        extra = self._prefill_slots(md, md.ring_start_empty)
        if md.ring_prefill_groups is not None:
            step = replace(md.ring_prefill_groups, state_indices=md.prefill_state_indices)
            extra.update(ring_prefill_groups=step, **step.vllm_rows())
        return replace(md, **extra)


def with_checkpoint_slots(prefill_slots: torch.Tensor, md) -> torch.Tensor:
    """`prefill_slots` and the blocks vLLM's FlashInfer GDN prefill writes checkpoints into this
    step (vLLM >= 0.33, align mode: `md.checkpoint.state_indices`, NULL_BLOCK_ID 0 for a row
    without one, which the ring's reset skips). Those blocks get a fresh state mid-chunk; a cursor
    left there by the block's earlier owner would replay stale entries onto it when a request
    later starts from the block, so their rings empty with the prefill slots'."""
    checkpoint = getattr(md, "checkpoint", None)
    if checkpoint is None:
        return prefill_slots
    return torch.cat([prefill_slots, checkpoint.state_indices.to(prefill_slots.dtype)])


class ReplayGDNAttentionBackend(GDNAttentionBackend):
    @staticmethod
    def get_builder_cls():
        return ReplayGDNAttentionMetadataBuilder

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        """No (vLLM >= 0.34 asks): adaptive verification trims verify windows on the device
        after the host metadata was built, and the ring's builder and verify have not been
        validated on such batches. The plan keeps those configs native; should a ring layer
        meet one anyway, vLLM refuses to start instead of running it."""
        return False
