#!/usr/bin/env bash
# Wheels for a GPU machine without internet that already has PyTorch (CUDA), transformers, accelerate and peft:
# trl-ext itself, TRL, and what such images usually lack (datasets, openai and their needs), at the versions
# installed on this machine (the ones trl-ext is tested with). No vLLM, no torch.
#
#   bash scripts/gpu_wheels.sh [DIR] [PYTHON_VERSION] [EXTRA_REQUIREMENT ...]
#     DIR: where the wheels go (default: wheels)
#     PYTHON_VERSION: the GPU machine's Python, major.minor (default: 3.12)
#     EXTRA_REQUIREMENT: more wheels, e.g. pyarrow==24.0.0 when pip there names one as missing or too old
#
# Then, on the GPU machine, from the checkout:
#   python3 -m pip install --no-index --find-links DIR trl-ext && python3 benchmarks/gpu.py
# (docs/scaling.md: "Measuring on your GPU"). pip there resolves against what is installed and stops with the
# name of anything still missing: download it here with EXTRA_REQUIREMENT.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-wheels}"
python_version="${2:-3.12}"
shift $(($# < 2 ? $# : 2))

# The packages a CUDA PyTorch image usually lacks, pinned to this machine's versions (installed with trl-ext).
names=(trl datasets dill multiprocess evaluate openai httpx2 httpcore2 truststore jiter pydantic pydantic-core
    annotated-types typing-inspection sniffio h11)
pins=()
for name in "${names[@]}"; do
    version="$(python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")" || {
        echo "gpu_wheels.sh: $name is not installed here; install trl-ext first (python -m pip install -e .)" >&2
        exit 1
    }
    pins+=("$name==$version")
done

mkdir -p "$dir"
python -m pip wheel --no-deps --no-build-isolation -q -w "$dir" .
python -m pip download --no-deps -q -d "$dir" --only-binary=:all: --implementation cp \
    --python-version "$python_version" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any "${pins[@]}" "$@"
ls "$dir"
