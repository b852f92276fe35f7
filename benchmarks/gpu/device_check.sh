#!/usr/bin/env bash
# On a machine with a GPU (a CUDA build of jaxlib, `pip install -e .[test]`): the fixture model on the
# GPU against the CPU (benchmarks/gpu/device_parity.py; bf16 goes through cuDNN flash attention), then
# `klein bench --config real-9b --sizes 1024` (random 9b weights, ~34 GB written on first use), in at
# most 10 minutes together. Prints the parity table, the bench table and a one-line summary.
# Run from the repository root: bash benchmarks/gpu/device_check.sh [results folder]
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-results/device_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if ! python -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 1)" 2>/dev/null; then
    echo "device_check: no GPU backend in JAX here (jax.default_backend() is not 'gpu'); install a CUDA jaxlib" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

start=$SECONDS
timeout 150 python benchmarks/gpu/device_parity.py | tee "$out/parity.md"
parity=${PIPESTATUS[0]}
parity_s=$((SECONDS - start))

left=$((590 - parity_s))
timeout "$left" python -c 'import sys; from klein.cli import main; sys.exit(main(sys.argv[1:]))' \
    bench --config real-9b --sizes 1024 --repeats 1 --out "$out" | tee "$out/bench.log"
bench=${PIPESTATUS[0]}

echo
echo "| check | exit status (0 = ok, 124 = out of time) | seconds |"
echo "|---|---|---|"
echo "| fixture parity GPU vs CPU | $parity | $parity_s |"
echo "| klein bench real-9b 1024 | $bench | $((SECONDS - start - parity_s)) |"
[ "$parity" -eq 0 ] && [ "$bench" -eq 0 ]
