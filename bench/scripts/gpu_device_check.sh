#!/bin/bash
# The GPU bitmask kernel's checks on a CUDA machine (docs/architecture.md §3.5): what `make test` cannot run here.
#
# Run from the repository root on a machine with an NVIDIA GPU, nvcc, CMake, ninja, pybind11, PyTorch with CUDA,
# pytest and hypothesis (a lent device machine of this workplace has them). Without network there, carry xgrammar
# (what bench.gpu_mask compares against) as wheels in .whl/ and they are installed first, e.g. for Python 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     xgrammar==0.2.8 apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection
# Steps: build the native core and the kernel library for sm_90 with native/CMakeLists.txt (LLM_SERVING_BUILD_CUDA=ON),
# run tests/native/test_gpu_kernel.py with nvcc required (its on-device test included), run that on-device test again
# under compute-sanitizer (memcheck, synccheck, initcheck; only the bitmask kernel is checked), then bench.gpu_mask.
# Logs go to $OUT (default ./gpu-check-out).
set -u
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
cmake -S native -B /tmp/gpu-check-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" \
  -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" -DLLM_SERVING_BUILD_CUDA=ON \
  -DLLM_SERVING_CUDA_ARCHITECTURES=90-real > "$OUT/build.log" 2>&1 \
  && cmake --build /tmp/gpu-check-build >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
cp /tmp/gpu-check-build/_native*.so /tmp/gpu-check-build/_mask_cuda.so serving_image/constraints/
echo "=== tests/native/test_gpu_kernel.py"
LLM_SERVING_REQUIRE_NVCC=1 timeout 300 python3 -m pytest -p no:cacheprovider tests/native/test_gpu_kernel.py -q -rs \
  > "$OUT/test_gpu_kernel.log" 2>&1
echo "pytest rc=$?"; tail -12 "$OUT/test_gpu_kernel.log"
for tool in memcheck synccheck initcheck; do
  echo "=== compute-sanitizer --tool $tool (the bitmask kernel only)"
  timeout 150 compute-sanitizer --tool "$tool" --kernel-name kns=mask_kernel --error-exitcode 9 \
    python3 -m pytest -p no:cacheprovider tests/native/test_gpu_kernel.py -q -k on_the_device \
    > "$OUT/sanitizer_$tool.log" 2>&1
  echo "$tool rc=$?"; tail -4 "$OUT/sanitizer_$tool.log"
done
echo "=== bench.gpu_mask"
timeout 240 python3 -m bench.gpu_mask --library serving_image/constraints/_mask_cuda.so --out "$OUT" 2>&1 \
  | tee "$OUT/gpu_mask.md" | tail -25
