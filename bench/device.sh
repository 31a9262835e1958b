#!/usr/bin/env bash
# The GPU checks in one device call (an H200 lent through the `device` tool): the gpu-marked
# tests (the kernels against the shared vectors, GPU against CPU, the testbed on CUDA),
# bench/gpu.py and bench/gpu_witness.py (the CUDA shim on real launches), their output saved
# under $OUT. The device image has torch, CuPy, NumPy,
# protobuf, grpcio and pytest; what else kvguard needs travels as wheels in .whl/ (ignored by
# git; see docs/operator.md, "GPU kernels", for the download command).
#
#   run(command="bash bench/device.sh", carry=[".whl"], timeout_s=480)
set -uo pipefail
out=${OUT:-/tmp/kvguard-device}
mkdir -p "$out" /tmp/pkg
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
python3 setup.py -q build_ext --inplace 2>&1 | tail -n 3  # the ledger's C extension, for this Python
cc -O2 -Wall -fPIC -shared -o cuda_hooks/shim/libkvguard_shim.so \
    $(ls cuda_hooks/shim/kvguard_*.c | grep -v kvguard_label) -ldl -lpthread  # the CUDA shim, as `make shim`
ln -sfn "$PWD" /tmp/pkg/kvguard  # the repository root is the package
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/device.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" | tee -a "$out/device.txt"
SECONDS=0
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/cuda_hooks/test_kernels.py tests/testbed/test_testbed_faults.py \
    2>&1 | tee "$out/gpu-tests.log"
echo "gpu tests: ${SECONDS} s" | tee -a "$out/device.txt"
SECONDS=0
timeout 200 python3 bench/gpu.py 2>&1 | tee "$out/gpu-bench.log"
echo "bench/gpu.py: ${SECONDS} s" | tee -a "$out/device.txt"
SECONDS=0
timeout 150 python3 bench/gpu_witness.py --rounds 3 2>&1 | tee "$out/gpu-witness.log"
echo "bench/gpu_witness.py: ${SECONDS} s" | tee -a "$out/device.txt"
