"""Patch point: `PrometheusStatLogger.log_metrics_info`, so that a server's /metrics shows the
ring's plan and counters. Where vLLM records `vllm:cache_config_info` (once per engine start, in
the front end), the wrapper records `replayssm_patch:plan_info`: an info gauge (always 1) whose
labels are the plan drawn from the same engine config, as each worker draws it; where that plan
has the ring, it also registers the collector of the workers' counters
(`replayssm_patch:ring_counters_total`, replayssm_patch.worker_counters). (The `use_replayssm`
label of vLLM's cache_config_info is vLLM's Mamba2 option, not this package.) In Prometheus
multiprocess mode (several API servers) vLLM serves only the metrics its multiprocess collector
gathers: the plan is there, the counters are not."""

from __future__ import annotations

import functools
import logging

from ..plan import Plan, front_end_plan
from ..state import STATE
from ..worker_counters import RingCountersCollector

METRIC = "replayssm_patch:plan_info"
LABELS = ("engine", "decision", "steps", "ring_len", "ring_dtype", "state_dtype", "verify_kernel", "reasons")


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_labels(plan: Plan) -> dict[str, str]:
    """The metric's labels for `plan` (engine excepted); empty strings where a label does not apply."""
    g = plan.geometry
    if g is None:
        return dict(decision="native", steps="", ring_len="", ring_dtype="", state_dtype="", verify_kernel="",
                    reasons="; ".join(map(str, plan.reasons)))
    spec = bool(plan.spec_tokens)
    return dict(decision="ring",
                steps=f"MTP T={plan.spec_tokens}" if spec else f"plain decode of >= {plan.min_batch} rows",
                ring_len=str(g.ring_len), ring_dtype=_dtype(g.ring_dtype), state_dtype=_dtype(g.state_dtype),
                verify_kernel=plan.verify_kernel if spec and plan.platform == "cuda" else "", reasons="")


def record(stat_logger, plan: Plan) -> None:
    """Set the gauge on `stat_logger`'s gauge class (vLLM's, so Prometheus multiprocess mode and
    Ray's wrapper behave as for vLLM's own info metrics) and, where the plan has the ring, register
    the counters' collector; what an earlier engine in this process left is unregistered first
    (Prometheus refuses a name twice)."""
    for old in (STATE.plan_gauge, STATE.counters_collector):
        _unregister(old)
    STATE.counters_collector = None
    gauge = stat_logger._gauge_cls(name=METRIC, documentation="replayssm_patch's plan for the GDN layers "
                                   "(1; labels: ring or native, on which steps, why native)",
                                   multiprocess_mode="mostrecent", labelnames=list(LABELS))
    STATE.plan_gauge = gauge
    labels = plan_labels(plan)
    for engine in stat_logger.engine_indexes:
        gauge.labels(engine=str(engine), **labels).set(1)
    if plan.geometry is not None and STATE.counters_dir is not None:
        from prometheus_client import REGISTRY

        STATE.counters_collector = RingCountersCollector(STATE.counters_dir)
        REGISTRY.register(STATE.counters_collector)


def _unregister(collector) -> None:
    from prometheus_client import REGISTRY

    if collector is not None:
        try:
            REGISTRY.unregister(collector)
        except KeyError:  # not in the default registry (Ray's wrapper)
            pass


def make_wrapper(native):
    @functools.wraps(native)
    def log_metrics_info(self, type: str, config_obj):
        native(self, type, config_obj)
        if type != "cache_config":
            return
        try:
            plan = front_end_plan(self.vllm_config, STATE.config)
            if plan is not None:
                record(self, plan)
        except Exception as e:  # a report must never stop a server from starting
            STATE.log_once(logging.WARNING, f"replayssm_patch: /metrics has no plan_info ({e.__class__.__name__}: {e})")

    return log_metrics_info
