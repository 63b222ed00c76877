"""Run Triton kernel checks under TRITON_INTERPRET=1 in one fresh subprocess.

TRITON_INTERPRET must be set before triton is first imported, and another test module of the
same pytest process may already have imported triton. So a test module runs its checks by
executing itself as a script (`collect(__file__)`), whose `__main__` block sets the variable and
calls `run_cases(CASES)`: one `RESULT {json}` line per check, which `collect` parses;
`interpreted_test(__file__, CASES)` is the pytest side, one test per check.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback

PREFIX = "RESULT "


def refuses(fn, good: dict, bad: dict) -> None:
    """fn(**good) with each bad argument in turn raises a ValueError naming it."""
    for name, value in bad.items():
        try:
            fn(**(good | {name: value}))
        except ValueError as e:
            assert name in str(e), e
        else:
            raise AssertionError(f"{fn.__name__} accepted a bad {name}")


def load_checks(script: str):
    """An interpreter test module loaded by path, so a GPU twin (tests/gpu/) runs its checks on
    CUDA tensors; `script` is the test file's path."""
    name = os.path.splitext(os.path.basename(script))[0] + "_checks"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cases(cases, only=()) -> int:
    """Run each check (a function returning a JSON-able dict); print one RESULT line each."""
    for case in cases:
        if only and case.__name__ not in only:
            continue
        t0 = time.perf_counter()
        try:
            rec = {"case": case.__name__, "ok": True, "info": case()}
        except Exception:  # reported to the parent, which fails that check's test
            rec = {"case": case.__name__, "ok": False, "error": traceback.format_exc()}
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        print(PREFIX + json.dumps(rec), flush=True)
    return 0


def collect(script: str, timeout: float = 600) -> dict:
    """Run `script` under the interpreter; {case name: record}. Raises RuntimeError with the
    subprocess's output when it produced no result at all (a crash before the first check)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    # the kernels of the tree the test file belongs to (tests/ beside replayssm_patch/), not
    # whichever checkout the environment's editable install points at (another worktree, say)
    tree = os.path.dirname(os.path.dirname(os.path.abspath(script)))
    if os.path.isdir(os.path.join(tree, "replayssm_patch")):
        env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, os.path.abspath(script)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith(PREFIX):
            rec = json.loads(line[len(PREFIX):])
            results[rec["case"]] = rec
    if not results:
        raise RuntimeError(f"interpreter subprocess produced no results (rc={proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return results


def interpreted_test(script: str, cases):
    """A pytest test function parametrized by the checks' names: the first one runs them all in
    one interpreter subprocess (`collect`), each reports its own check. Marked `slow`; skipped
    without torch and triton."""
    import pytest

    outcome = {}  # "results" (dict) or "error" (str), once per module

    @pytest.mark.slow  # one interpreter subprocess: seconds to minutes per module
    @pytest.mark.parametrize("case", [c.__name__ for c in cases])
    def test(case):
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
            pytest.skip("torch and triton are needed for the interpreter tests")
        if not outcome:
            try:
                outcome["results"] = collect(script)
            except RuntimeError as e:
                outcome["error"] = str(e)
        if "error" in outcome:
            pytest.fail(outcome["error"])
        rec = outcome["results"].get(case)
        assert rec is not None, f"{case} did not run"
        assert rec["ok"], rec.get("error")

    return test
