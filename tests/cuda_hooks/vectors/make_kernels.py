"""Writes tests/cuda_hooks/vectors/kernels.json: inputs of the page-tag check and the page checksum, and
their results, computed here by plain Python loops straight from the definitions (not by the
NumPy, PyTorch or CUDA code under test), so that each implementation is checked against the
definition rather than against another implementation.

    python tests/cuda_hooks/vectors/make_kernels.py   # rewrites the file; its content is deterministic
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

MULTIPLIER = 0x9E3779B1
OUT = Path(__file__).with_name("kernels.json")


def lcg_bytes(n: int, seed: int) -> bytes:
    """Deterministic bytes that look like KV (no two pages alike)."""
    state, out = seed, bytearray()
    while len(out) < n:
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out += struct.pack("<I", state >> 32)
    return bytes(out[:n])


def checksum_case(
    name: str, dtype: str, elem: int, layers: int, pool_pages: int, block: int, pages: list[int]
):
    """block: elements per (layer, page) K or V block (page_size * heads * head_dim)."""
    k = lcg_bytes(layers * pool_pages * block * elem, seed=len(name))
    v = lcg_bytes(layers * pool_pages * block * elem, seed=len(name) + 99)
    nbytes = block * elem
    sums = []
    for page in pages:
        stream = b""
        for layer in range(layers):
            at = (layer * pool_pages + page) * nbytes
            stream += k[at : at + nbytes] + v[at : at + nbytes]
        words = struct.unpack(f"<{len(stream) // 4}I", stream)
        sums.append(sum(w * (2 * i + 1) * MULTIPLIER for i, w in enumerate(words)) % 2**64)
    return {
        "name": name,
        "dtype": dtype,
        "shape": [layers, pool_pages, block],
        "k": base64.b64encode(k).decode(),
        "v": base64.b64encode(v).decode(),
        "pages": pages,
        "checksums": [str(s) for s in sums],  # strings: JSON numbers lose bits past 2**53
    }


def tag_case(
    name: str,
    own: list[int],
    valid: list[int],
    tables: list[list[int]],
    lens: list[int],
    readers: list[int],
    page_size: int,
):
    clean = []
    for table, length, reader in zip(tables, lens, readers, strict=True):
        ok = reader != 0 and length <= len(table) * page_size
        for col in range(-(-length // page_size)):
            if col >= len(table):
                break
            need = min(length - col * page_size, page_size)
            p = table[col]
            if not (0 <= p < len(own)) or own[p] != reader or valid[p] < need:
                ok = False
        clean.append(ok or length == 0)
    return {
        "name": name,
        "own": own,
        "valid": valid,
        "tables": tables,
        "lens": lens,
        "readers": readers,
        "page_size": page_size,
        "clean": clean,
    }


def main() -> None:
    ps = 4
    own = [0, 1, 1, 1, 2, 2, 3, 0, 3, 3, 1, 2]
    valid = [0, 4, 4, 2, 4, 1, 4, 4, 4, 3, 4, 4]
    tags = [
        tag_case(
            "batch",
            own,
            valid,
            # r1: pages 1, 2, 3 (the last half full, read 2 of it); r2: its second page holds 1 slot
            # but 3 are read; r3: reads its own pages, the middle one short (a hole read in full);
            # r1 again with garbage beyond its context; a page out of range; an unknown reader;
            # nothing read; a table too short for its context; another request's page.
            [
                [1, 2, 3],
                [4, 5, 0],
                [6, 9, 8],
                [1, 2, 77],
                [1, 99, 0],
                [1, 2, 3],
                [0, 0, 0],
                [6, 8, 0],
                [1, 4, 0],
            ],
            [10, 7, 12, 8, 8, 8, 0, 13, 8],
            [1, 2, 3, 1, 1, 0, 5, 3, 1],
            ps,
        ),
        tag_case("empty", own, valid, [], [], [], ps) | {"tables": [], "width": 3},
    ]
    sums = [
        checksum_case("float32", "float32", 4, 2, 6, 4 * 2 * 4, [0, 5, 2, 2]),
        checksum_case("bfloat16", "bfloat16", 2, 3, 5, 4 * 2 * 8, [4, 1, 0]),
        checksum_case("float16-one-layer", "float16", 2, 1, 3, 16 * 1 * 2, [2]),
    ]
    OUT.write_text(json.dumps({"tag_check": tags, "checksums": sums}, indent=1) + "\n")


if __name__ == "__main__":
    main()
