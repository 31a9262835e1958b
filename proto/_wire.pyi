"""Types of the C extension kvguard.proto._wire (proto/_wire.c, proto/encode.c), as
proto/wire.py calls it. Every function takes its arguments by position only (METH_O or
METH_FASTCALL); page, count, slot and grant arrays are contiguous 1-d int64."""

import numpy as np
import numpy.typing as npt

HEAD: np.dtype[np.void]  # one event's head (wire.h: WireHead)

def head(body: bytes, /) -> tuple[int, str, int, int, str, int, int, int, int, int] | None: ...
def single(body: bytes, /) -> npt.NDArray[np.void]: ...
def batch(data: bytes, wrapped: bool, /) -> npt.NDArray[np.void] | None: ...
def of_node(data: bytes, heads: npt.NDArray[np.void], node: bytes, /) -> npt.NDArray[np.uint8]: ...
def digests(data: bytes, heads: npt.NDArray[np.void], start: int, stop: int, /) -> npt.NDArray[np.int64]: ...
def encode(
    kind: int,
    node: str,
    seq: int,
    ts: int,
    epoch: int,
    req: str,
    pool: int,
    pages: npt.NDArray[np.int64],
    slots: npt.NDArray[np.int64] | None,
    /,
) -> bytes: ...
def encode_allocs(
    node: str,
    seq: int,
    ts: int,
    epoch: int,
    reqs: list[str],
    pool: int,
    pages: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    /,
) -> bytes: ...
def encode_step(
    node: str,
    seq: int,
    ts: int,
    epoch: int,
    pool: int,
    reqs: list[str] | npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    pages: npt.NDArray[np.int64],
    slots: npt.NDArray[np.int64] | None,
    grants: npt.NDArray[np.int64] | None = None,
    /,
) -> bytes: ...
def encode_pass(
    node: str,
    seq: int,
    ts: int,
    epoch: int,
    pool: int,
    reqs: list[str],
    counts: npt.NDArray[np.int64],
    pages: npt.NDArray[np.int64],
    slots: npt.NDArray[np.int64] | None,
    grants: npt.NDArray[np.int64],
    /,
) -> bytes: ...
