"""Regenerate the Python code of proto/kvguard/v1/*.proto (``make proto``).

Invariant: the committed ``*_pb2.py``/``*_pb2.pyi`` files are exactly what this script writes
with the pinned grpcio-tools; tests/proto/test_proto.py regenerates into a temporary folder and
fails when they differ. Generated imports are rewritten from ``kvguard.v1`` to the package
path ``kvguard.proto.kvguard.v1``, where the code lives.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = Path("kvguard") / "v1"
_IMPORT = re.compile(r"^from kvguard\.v1 import", re.MULTILINE)


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules for every .proto under PROTO_ROOT/kvguard/v1 into
    out_root/kvguard/v1 and return their paths."""
    from grpc_tools import protoc  # build-time dependency only

    sources = sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    include = str(Path(protoc.__file__).resolve().parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        for source in sources:
            args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}", f"--pyi_out={tmp}"]
            if re.search(r"^service ", source.read_text(), re.MULTILINE):
                args.append(f"--grpc_python_out={tmp}")
            args.append(str(source.relative_to(PROTO_ROOT)))
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {source}")
        written = []
        (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
        for produced in sorted((Path(tmp) / PACKAGE_DIR).iterdir()):
            text = _IMPORT.sub("from kvguard.proto.kvguard.v1 import", produced.read_text())
            target = out_root / PACKAGE_DIR / produced.name
            target.write_text(text)
            written.append(target)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT):
        print(f"wrote {path}")
