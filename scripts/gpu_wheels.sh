#!/usr/bin/env bash
# The small wheels a CUDA machine without TorchRec needs to run the package's GPU
# tests (`make test-gpu`) and benchmark (`make bench-gpu`); docs/gpu.md.
#
#   scripts/gpu_wheels.sh [download]    on a machine with PyPI: fetch them into gpu_wheels/
#   scripts/gpu_wheels.sh install PY    on the GPU machine: install into interpreter PY
#                                       those whose module PY cannot import
#
# What is fetched, for the GPU machine's Python and torch (defaults: Python 3.12,
# torch 2.11), with `pip download --no-deps --only-binary=:all:`:
#   fbgemm-gpu-cpu  FBGEMM's CPU build (5-6 MB; the CUDA build is 465 MB and cannot
#                   travel): TorchRec imports fbgemm_gpu, the package's CPU paths use it
#   torchrec        pure Python, the release of the same cycle as that FBGEMM
#   tensordict      imported by torchrec (a pure-Python release that supports the torch),
#   pyvers          and tensordict's needs that such a machine may lack:
#   cloudpickle
#   iopath          imported by torchrec.datasets and torchrec.models (the examples),
#   portalocker     and its needs
#   tqdm            (also a need of this package)
# `install` installs only those whose module does not import (a machine's own
# cloudpickle or tqdm, or a CUDA fbgemm_gpu, is left alone).
#
# Environment: GPU_PYTHON_VERSION (3.12), GPU_TORCH (2.11), GPU_WHEELS_DIR (gpu_wheels),
# PYTHON (python3: the pip that downloads), FBGEMM_VERSION / TORCHREC_VERSION (override
# the pair chosen for GPU_TORCH), GPU_WHEELS_MAX_MIB (32: the set must stay well
# under the 64 MiB that may travel with a working tree).
set -euo pipefail

DEST=${GPU_WHEELS_DIR:-gpu_wheels}
PY_VERSION=${GPU_PYTHON_VERSION:-3.12}
TORCH_VERSION=${GPU_TORCH:-2.11}
MAX_MIB=${GPU_WHEELS_MAX_MIB:-32}
PYTHON=${PYTHON:-python3}

# FBGEMM and TorchRec release together, one cycle per torch release (why these:
# docs/gpu.md). Only the pairs reasoned out there are known here.
case "$TORCH_VERSION" in
    2.11) PAIR_FBGEMM=1.6.0 PAIR_TORCHREC=1.6.1 ;;
    *) PAIR_FBGEMM="" PAIR_TORCHREC="" ;;
esac
FBGEMM_VERSION=${FBGEMM_VERSION:-$PAIR_FBGEMM}
TORCHREC_VERSION=${TORCHREC_VERSION:-$PAIR_TORCHREC}

# tensordict 0.15.3: pure Python, requires torch >= 2.11 (the releases before it
# carry a C++ extension built for one torch). iopath 0.1.9: the last with a wheel.
PURE=(
    "tensordict==0.15.3"
    "pyvers==0.2.3"
    "cloudpickle==3.1.3"
    "iopath==0.1.9"
    "portalocker==4.4.2"
    "tqdm==4.70.1"
)

# One line: a byte count in MiB, then a label.
mib() {
    awk -v bytes="$1" -v label="$2" 'BEGIN { printf "%9.2f MiB  %s\n", bytes / 1048576, label }'
}

download() {
    if [[ -z "$FBGEMM_VERSION" || -z "$TORCHREC_VERSION" ]]; then
        echo "gpu_wheels.sh: no known fbgemm/torchrec pair for torch $TORCH_VERSION;" \
            "set FBGEMM_VERSION and TORCHREC_VERSION (docs/gpu.md says how to choose)" >&2
        exit 2
    fi
    local tag=${PY_VERSION/./}
    local fetch=("$PYTHON" -m pip download --quiet --no-deps --only-binary=:all:
        --python-version "$PY_VERSION" --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)
    mkdir -p "$DEST"
    # One version of each: an older set's wheels would make pip refuse to install.
    rm -f "$DEST"/*.whl
    "${fetch[@]}" --abi "cp$tag" -d "$DEST" "fbgemm-gpu-cpu==$FBGEMM_VERSION"
    "${fetch[@]}" -d "$DEST" "torchrec==$TORCHREC_VERSION" "${PURE[@]}"
    local total=0 size
    for wheel in "$DEST"/*.whl; do
        size=$(stat -c %s "$wheel")
        total=$((total + size))
        mib "$size" "$(basename "$wheel")"
    done
    mib "$total" "in all ($(ls "$DEST"/*.whl | wc -l) wheels, for CPython $PY_VERSION and torch $TORCH_VERSION)"
    if ((total > MAX_MIB * 1048576)); then
        echo "gpu_wheels.sh: $DEST/ holds more than $MAX_MIB MiB" >&2
        exit 1
    fi
}

# The module a wheel installs, from its file name.
module_of() {
    local dist
    dist=$(basename "$1" | cut -d- -f1)
    case "$dist" in
        fbgemm_gpu_cpu | fbgemm_gpu) echo fbgemm_gpu ;;
        *) echo "$dist" ;;
    esac
}

install() {
    local py=${1:?usage: gpu_wheels.sh install PYTHON}
    if "$py" -c "import fbgemm_gpu, torchrec" 2>/dev/null; then
        echo "gpu_wheels.sh: torchrec and fbgemm_gpu import already: nothing to install"
        return
    fi
    shopt -s nullglob
    local all=("$DEST"/*.whl) wheels=() wheel module
    if ((${#all[@]} == 0)); then
        echo "gpu_wheels.sh: torchrec or fbgemm_gpu does not import and $DEST/ holds no wheels:" \
            "run scripts/gpu_wheels.sh on a machine with PyPI and bring $DEST/ along" \
            "(docs/gpu.md)" >&2
        exit 2
    fi
    for wheel in "${all[@]}"; do
        module=$(module_of "$wheel")
        if ! "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$module') is None)"; then
            wheels+=("$wheel")
        fi
    done
    echo "gpu_wheels.sh: installing into $py: ${wheels[*]##*/}"
    "$py" -m pip install --quiet --no-index --no-deps --no-cache-dir "${wheels[@]}"
}

case "${1:-download}" in
    download) download ;;
    install) install "${2:-}" ;;
    *)
        echo "usage: scripts/gpu_wheels.sh [download | install PYTHON]" >&2
        exit 2
        ;;
esac
