"""Patch point: `WorkerBase.replayssm_status`, so that `status(llm)` can ask vLLM's workers
(`llm.collective_rpc("replayssm_status")`) for their report: the GDN layers and the ring's
counters live where vLLM builds the model, by default another process."""

from __future__ import annotations


def replayssm_status(self) -> dict:
    """This worker process's patch report (replayssm_patch.status() there)."""
    from ..activation import report

    return report()
