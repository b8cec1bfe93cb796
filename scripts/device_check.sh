#!/usr/bin/env bash
# One prepared run on the GPU machine (H200, jax with CUDA): install the package, run the kernel
# tests with the Pallas kernel lowered through Triton (not interpreted: tests pick interpret
# mode only off GPU), then the GPU part of the attention benchmark. Everything lands in $OUT.
#
#   OUT=/some/dir bash scripts/device_check.sh
#
# The install uses --no-build-isolation: that machine reaches no registry to fetch setuptools.
# f32 tests compare at f32 tolerance, so the reference's XLA dots must not run in TF32:
# JAX_DEFAULT_MATMUL_PRECISION=highest (the kernel asks for HIGHEST itself).
set -u
OUT="${OUT:?set OUT to an output directory}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

{
  echo "date: $(date -u +%FT%TZ)"
  echo "git: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
} > "$OUT/env.txt"

"$PY" -m pip install --no-deps --no-build-isolation -e . > "$OUT/pip_install.log" 2>&1
echo "pip rc=$?" >> "$OUT/env.txt"
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())" \
  >> "$OUT/env.txt" 2>&1

# 1. Kernel tests, lowered on the GPU (default subset; the slow sweep only if time allows).
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 330 "$PY" -m pytest -q tests/kernels -m "not slow" \
  -p no:cacheprovider --durations=10 > "$OUT/tests_kernels.log" 2>&1
echo "tests rc=$?" >> "$OUT/env.txt"

# 2. GPU benchmark (Qwen2.5-7B decode shape: B 32, ctx 32768, 28/4 heads, D 128, bf16, page 16).
timeout 200 "$PY" -m experiments.bench_attention --json --skip_cpu --repeats 20 \
  --out "$OUT/bench_attention_gpu.json" > "$OUT/bench_attention_gpu.log" 2>&1
echo "bench rc=$?" >> "$OUT/env.txt"
cat "$OUT/env.txt"
tail -n 5 "$OUT/tests_kernels.log"
tail -n 3 "$OUT/bench_attention_gpu.log"
