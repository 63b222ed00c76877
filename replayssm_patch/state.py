"""What the patch holds in one process: the one mutable object of the package (`STATE`).

The config in force, what was installed and how to undo it, each GDN layer's decision, the ring
operations' counters and the log lines already written. `status()` reports it; tests start from
`STATE.reset()`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from . import worker_counters
from .config import ReplayConfig

logger = logging.getLogger("vllm.replayssm_patch")


class PatchRefused(RuntimeError):
    """Strict mode: the ring cannot serve where it was asked to (the message says why)."""


@dataclass
class PatchState:
    config: ReplayConfig = field(default_factory=ReplayConfig)
    applied: bool = False
    vllm_version: str | None = None
    reasons: list[str] = field(default_factory=list)  # why the patch was not applied
    warnings: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)  # what install() changed (the table's names)
    undo: list[Callable[[], None]] = field(default_factory=list)  # newest last
    layers: dict[str, str] = field(default_factory=dict)  # GDN layer prefix -> "ring" | "native: why"
    stats: Counter = field(default_factory=Counter)  # ring operations run in this process
    logged: set[str] = field(default_factory=set)
    log_keys: set[str] = field(default_factory=set)  # log_once keys already written
    # the config in force when vLLM created this process's first engine (the plugin notes it):
    # a later patch() with other options came too late for that engine
    engine_config: ReplayConfig | None = None
    engine_started: bool = False
    stats_logged_at: float = 0.0  # monotonic time of the last counters line
    counters_dir: str | None = None  # where this process's counters go for /metrics (worker_counters)
    counters_publisher_pid: int | None = None  # the process whose thread writes them there
    plan_gauge: object = None  # the /metrics gauge this process registered (vllm/metrics_info.py)
    counters_collector: object = None  # and the /metrics collector of the workers' counters

    def log_stats_every(self, seconds: float) -> None:
        """At most every `seconds`, one INFO line with the ring's counters (a server's operator sees
        the ring at work in the log, as vLLM's own throughput lines)."""
        now = time.monotonic()
        if now - self.stats_logged_at < seconds or not self.stats:
            return
        self.stats_logged_at = now
        keys = ("decode_rows", "verify_rows", "flushes", "native_decode_calls", "materialize_calls")
        logger.info("replayssm_patch: ring counters in this worker: " +
                    ", ".join(f"{k}={self.stats[k]}" for k in keys if k in self.stats))

    def publish_stats_in_background(self, seconds: float) -> None:
        """Keep this process's ring counters in the file the front end's /metrics reads
        (worker_counters): a daemon thread of this process writes them every `seconds` when they
        changed. A thread, not the engine's step, so that the steps just before serving goes idle
        reach /metrics too. Started once per process (a forked child starts its own); a directory
        that cannot be written is given up, with a warning."""
        if self.counters_dir is None or self.counters_publisher_pid == os.getpid():
            return
        self.counters_publisher_pid = os.getpid()
        threading.Thread(target=self._publish_stats_loop, args=(self.counters_dir, seconds),
                         name="replayssm-counters", daemon=True).start()

    def _publish_stats_loop(self, directory: str, seconds: float) -> None:
        published: dict[str, int] = {}
        while self.counters_dir == directory:  # reset() or a failed write ends it
            counters = dict(self.stats)  # one C-level copy under the GIL: never half a step's update
            if counters and counters != published:
                try:
                    worker_counters.publish(directory, counters)
                except OSError as e:
                    self.log_once(logging.WARNING, f"replayssm_patch: the ring's counters stay out of "
                                                   f"/metrics ({type(e).__name__}: {e})")
                    self.counters_dir = None
                    return
                published = counters
            time.sleep(seconds)

    def log_once(self, level: int, msg: str, key: str | None = None) -> None:
        """Log `msg` once per process: once per text, or, with `key`, once per key (its first text)."""
        if msg in self.logged or (key is not None and key in self.log_keys):
            return
        self.logged.add(msg)
        if key is not None:
            self.log_keys.add(key)
        logger.log(level, msg)

    def reset(self) -> None:
        """Forget everything (tests): undo what was installed, then start afresh."""
        while self.undo:
            self.undo.pop()()
        self.__init__()


STATE = PatchState()
