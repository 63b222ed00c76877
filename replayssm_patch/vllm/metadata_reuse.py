"""Patch point: the ring's metadata builder opts into vLLM's reuse of one GDN cache group's
metadata for the others (`update_block_table`, vLLM >= 0.31, CUDA). vLLM enables it for its own
builder class only (`type(self) is GDNAttentionMetadataBuilder`), and only under its V2 model
runner (0.31-0.33: `use_v2_model_runner`; 0.34 has no other runner and no such flag); without it
every GDN group rebuilds all its metadata on the host every step. The ring's fields are
batch-level flags plus per-group prefill slot lists, which the builder's update_block_table
recomputes. Not with MTP: the commit slots need each step's accepted counts."""

from __future__ import annotations

import torch

from .. import versions


def opt_in(builder, vllm_config, device) -> None:
    """Set vLLM's reuse attributes on `builder` where vLLM's own builder would have them."""
    caps = versions.capabilities()
    runner_v2 = caps.mrv2_only or getattr(vllm_config, "use_v2_model_runner", False)
    if builder.num_spec or not caps.gdn_metadata_reuse or not runner_v2 or torch.device(device).type != "cuda":
        return
    builder.supports_update_block_table = True
    builder.mamba_aligned_state_indices = None  # what vLLM's runner fills in align mode
