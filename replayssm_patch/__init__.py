"""ReplaySSM decode for the Gated DeltaNet layers of Qwen3-Next / Qwen3.5 in released vLLM.

    import replayssm_patch
    replayssm_patch.patch()          # before the vLLM engine starts

or set VLLM_GDN_REPLAYSSM=1 with the package installed (its vLLM plugin applies it in every
vLLM process). The options are ReplayConfig's fields (README "Options").
"""

from __future__ import annotations

import os

from .config import OptionError, ReplayConfig, declare_to_vllm, from_kwargs
from .state import PatchRefused

__version__ = "0.2.0"
__all__ = ["patch", "unpatch", "status", "ReplayConfig", "OptionError", "PatchRefused"]


def patch(enable: bool = True, **options) -> dict:
    """Turn ReplaySSM GDN decode on (or off) for this process and the vLLM processes it starts.

    Keywords are ReplayConfig's fields (ring_len, min_batch, allow_mtp, ring_dtype, mtp_kernel,
    strict; README "Options" gives their accepted values); an unknown keyword or a bad value raises
    OptionError naming it, before anything changes. Where the ring serves by default is the plan's
    decision (replayssm_patch.plan): MTP on CUDA on the releases a GPU run validated, plain decode
    where its rule predicts a gain.

    Returns a report: whether it applied, what was patched, and every reason it did not.
    """
    config = from_kwargs(enable=enable, **options)
    os.environ.update(config.to_env())  # vLLM's processes start with a copy of the environment
    declare_to_vllm()
    from . import activation

    activation.install_hooks()  # as the plugin does: vLLM's --use-replayssm reaches the ring
    return activation.apply(config)


def unpatch() -> None:
    """Undo `patch()` in this process; vLLM processes started later stay native."""
    from . import activation

    os.environ.update(ReplayConfig().to_env())
    activation.revert()
    activation.apply(ReplayConfig())


def status(llm=None) -> dict:
    """What the patch did: options, patch points, each GDN layer's decision, counters.

    Without `llm`, this process's view. With an `LLM` (or anything with `collective_rpc`), the
    layers and counters of its workers, where vLLM builds the model (by default in another
    process): `workers` lists each rank's report, and `layers` / `counters` are rank 0's and the
    sum over ranks.
    """
    from . import activation

    report = activation.report()
    if llm is None:
        return report
    try:
        workers = llm.collective_rpc("replayssm_status")
    except Exception as e:  # the workers run without the patch (their method is ours)
        report["workers"] = []
        report["warnings"] = report["warnings"] + [f"the engine's workers report nothing: {type(e).__name__}: {e}"]
        return report
    report["workers"] = workers
    if workers:
        report["layers"] = dict(workers[0]["layers"])
        counters: dict = {}
        for w in workers:
            for k, v in w["counters"].items():  # counts add up; a worst case ("..._max_...") does not
                counters[k] = max(counters.get(k, v), v) if "_max_" in k else counters.get(k, 0) + v
        report["counters"] = counters
    return report
