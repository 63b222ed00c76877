"""The ring's counters, from vLLM's workers to the front end's `/metrics`.

The counters live where vLLM builds the model (by default another process than the server's).
Each worker's thread writes its counters, every `PUBLISH_SECONDS` when they changed, to a
file of its own in a directory that the first patched process creates and names in the
environment (`ENV`), so that every vLLM process started from it writes there; the front end's
collector reads the files of the workers still alive at each scrape. Workers on other hosts (Ray)
write to a directory of their own host, which no front end reads: their counters stay in their
log line and `status(llm)`. Counters whose name says `_max_` are worst cases, not counts, and are
not exported.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import MutableMapping

ENV = "REPLAYSSM_PATCH_COUNTERS_DIR"  # no option, so not VLLM_*: vLLM checks those against its table
PUBLISH_SECONDS = 1.0
METRIC = "replayssm_patch:ring_counters"  # Prometheus shows a counter family with "_total"


def shared_dir(env: MutableMapping[str, str]) -> str:
    """The directory `env` names; where it names none (or one that does not exist on this host),
    a new one, named in `env` for the processes started from this one and removed when this
    process exits."""
    named = env.get(ENV, "")
    if named and os.path.isdir(named):
        return named
    made = tempfile.mkdtemp(prefix="replayssm-counters-")
    atexit.register(shutil.rmtree, made, True)
    env[ENV] = made
    return made


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def publish(directory: str, counters: dict[str, int]) -> None:
    """Write this process's `counters` to its file in `directory` (replaced whole, so a reader
    never sees half of it)."""
    pid = os.getpid()
    body = json.dumps({"pid": pid, "rank": _rank(), "counters": counters})
    tmp = Path(directory, f".{pid}.json.tmp")
    tmp.write_text(body)
    os.replace(tmp, Path(directory, f"{pid}.json"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def read(directory: str) -> list[dict]:
    """The files in `directory` of processes still alive (a worker of an engine that is gone no
    longer counts), each `{"pid", "rank", "counters"}`, ordered by rank then pid."""
    workers = []
    for path in Path(directory).glob("*.json"):
        try:
            worker = json.loads(path.read_text())
        except (OSError, ValueError):  # removed while listed, or not ours
            continue
        if isinstance(worker, dict) and isinstance(worker.get("pid"), int) and _alive(worker["pid"]):
            workers.append(worker)
    return sorted(workers, key=lambda w: (w.get("rank", 0), w["pid"]))


class RingCountersCollector:
    """A Prometheus collector: one counter family, a sample per worker and counter
    (labels `rank`, `pid`, `counter`), read from `directory` at each scrape."""

    def __init__(self, directory: str):
        self.directory = directory

    def describe(self):
        return []  # the samples are known only at a scrape

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(METRIC, "replayssm_patch's ring operations in each vLLM worker, as the "
                                     "worker last wrote them", labels=["rank", "pid", "counter"])
        for worker in read(self.directory):
            for name, value in sorted(worker.get("counters", {}).items()):
                if "_max_" not in name:
                    family.add_metric([str(worker.get("rank", 0)), str(worker["pid"]), name], value)
        yield family
