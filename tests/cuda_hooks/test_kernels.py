"""The guard's GPU kernels and their CPU twins against shared test vectors
(tests/cuda_hooks/vectors/kernels.json, computed by plain loops from the definitions). The CPU path runs
here and in CI; the kernels' source is compiled with NVRTC for the H200 here too (no GPU
needed to compile), and runs against the same vectors on a GPU (`pytest -m gpu`)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvguard.cuda_hooks import kernels
from kvguard.ledger.ledger import Ledger
from kvguard.ledger.pages import check_tags
from kvguard.proto.builder import EventLog
from kvguard.testbed.paged import KVPool

VECTORS = json.loads((Path(__file__).parent / "vectors" / "kernels.json").read_text())
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pool_of(case: dict[str, Any], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    layers, pool_pages, block = case["shape"]
    dtype = DTYPES[case["dtype"]]

    def tensor(data: str) -> torch.Tensor:
        raw = bytearray(base64.b64decode(data))
        return torch.frombuffer(raw, dtype=dtype).reshape(layers, pool_pages, block).to(device)

    return tensor(case["k"]), tensor(case["v"])


def tag_inputs(case: dict[str, Any]) -> tuple[np.ndarray, ...]:
    tables = np.array(case["tables"], dtype=np.int32).reshape(
        len(case["lens"]), -1 if case["lens"] else case["width"]
    )
    return (
        np.array(case["own"], np.int32),
        np.array(case["valid"], np.uint32),
        tables,
        np.array(case["lens"], np.int32),
        np.array(case["readers"], np.int32),
    )


@pytest.mark.parametrize("case", VECTORS["tag_check"], ids=lambda c: c["name"])
def test_the_cpu_tag_check_reproduces_the_vectors(case: dict[str, Any]) -> None:
    own, valid, tables, lens, readers = tag_inputs(case)
    assert check_tags(own, valid, tables, lens, readers, case["page_size"]).tolist() == case["clean"]


@pytest.mark.parametrize("case", VECTORS["checksums"], ids=lambda c: c["name"])
def test_the_cpu_checksums_reproduce_the_vectors(case: dict[str, Any]) -> None:
    k, v = pool_of(case)
    got = kernels.page_checksums(k, v, torch.tensor(case["pages"]))
    assert [str(x) for x in got.tolist()] == case["checksums"]


def test_the_testbed_pool_checksums_through_the_same_code() -> None:
    # The testbed's KVPool is [layers, pages, page_size, heads, head_dim]: the vectors' float32
    # case is a pool of pages of 4 slots, 2 heads of 4.
    case = VECTORS["checksums"][0]
    k, v = pool_of(case)
    pool = KVPool(num_pages=k.shape[1], page_size=4, num_layers=k.shape[0], num_kv_heads=2, head_dim=4)
    pool.k.copy_(k.reshape(pool.k.shape))
    pool.v.copy_(v.reshape(pool.v.shape))
    assert [str(x) for x in pool.page_checksums(torch.tensor(case["pages"])).tolist()] == case["checksums"]


def test_the_ledgers_batch_check_is_the_tag_check() -> None:
    # A request that wrote its pages reads clean; after its pages go to another tenant's
    # request that wrote only half of one, neither that request (a hole) nor the first (freed)
    # is clean: the tags the kernel reads are the ledger's own.
    log = EventLog()
    log.add("n0", "pool", pool=0, role="decode", page_size=4, num_pages=8, context_len=32)
    for req, tenant in (("a", "acme"), ("b", "globex")):
        log.add("n0", "admit", req=req, tenant=tenant, prompt_tokens=8, stage="decode")
    log.add("n0", "alloc", req="a", pool=0, pages=[1, 2])
    log.add("n0", "write", req="a", pool=0, pages=[1, 2])
    ledger = Ledger()
    for e in log.events:
        ledger.apply(e)
    tables, lens = np.array([[1, 2], [1, 2]]), np.array([8, 8])
    assert ledger.batch_clean("n0", 0, ["a", "b"], tables, lens).tolist() == [True, False]
    for e in (
        log.add("n0", "free", req="a", pool=0, pages=[1, 2]),
        log.add("n0", "alloc", req="b", pool=0, pages=[1, 2]),
    ):
        ledger.apply(e)
    ledger.apply(log.add("n0", "write", req="b", pool=0, pages=[1, 2], slots=[4, 2]))
    assert ledger.batch_clean("n0", 0, ["a", "b"], tables, lens).tolist() == [False, False]
    pp = ledger.nodes["n0"].pools[0].pages
    readers = ledger.reader_indices(["a", "b"])
    assert check_tags(pp.own, pp.valid, tables, np.array([8, 6]), readers, 4).tolist() == [False, True]
    # b reads 6 tokens clean; nobody named "zz" reads anything as its own; one that reads
    # nothing is clean; once b is killed, its own clean pages are no longer clean to read.
    names, lens = ["b", "zz", "zz"], np.array([6, 6, 0], np.int32)
    assert ledger.batch_clean("n0", 0, names, tables[[1, 1, 1]], lens).tolist() == [True, False, True]
    ledger.apply(log.add("n0", "kill", req="b", finding="foreign_read", by="test"))
    assert ledger.batch_clean("n0", 0, ["b", "b"], tables, np.array([6, 0])).tolist() == [False, True]
    with pytest.raises(ValueError, match="a batch of 2 tables, 2 lens, 1 requests"):
        ledger.batch_clean("n0", 0, ["b"], tables, lens[:2])


@pytest.mark.parametrize("quads", [True, False], ids=["16-byte loads", "4-byte loads"])
def test_the_checksum_kernels_stepped_weights_are_the_definitions(quads: bool) -> None:
    # The kernel never multiplies out (2i + 1) * C per word: each thread starts from its first
    # word's weight and adds a fixed step. The same loops in Python integers mod 2**64 (a
    # check of that algebra here; on a GPU the kernel itself is checked against the vectors).
    mask, c = 2**64 - 1, kernels.CHECKSUM_MULTIPLIER
    size = 256  # words per block: each thread of the 16 takes several steps
    words = [(i * 2654435761 + 12345) % 2**32 for i in range(2 * size)]  # two blocks
    expected = sum(w * (2 * i + 1) * c for i, w in enumerate(words)) & mask
    total, threads, chunks = 0, 8, 2
    for block in range(2):
        src, first = words[block * size : (block + 1) * size], block * size
        stride = threads * chunks
        for t in range(stride):
            if quads:
                weight, step, advance = ((2 * (first + 4 * t) + 1) * c) & mask, 2 * c, 8 * stride * c
                for q in range(t, size // 4, stride):
                    total += sum(src[4 * q + j] * ((weight + j * step) & mask) for j in range(4))
                    weight = (weight + advance) & mask
            else:
                weight, advance = ((2 * (first + t) + 1) * c) & mask, 2 * stride * c
                for i in range(t, size, stride):
                    total += src[i] * weight
                    weight = (weight + advance) & mask
    assert total & mask == expected


def test_the_kernels_compile_for_the_h200() -> None:
    # NVRTC, no GPU needed: a kernel that does not compile is found here, not on the device.
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(kernels.SOURCE, "kvguard_kernels.cu", [], [])
    try:
        nvrtc.compileProgram(program, ["-arch=compute_90", "-default-device"])
    except nvrtc.NVRTCError:
        pytest.fail(nvrtc.getProgramLog(program))
    ptx = nvrtc.getPTX(program)
    for kernel in (b"kvguard_tag_check", b"kvguard_page_checksums"):
        assert b".entry " + kernel in ptx


# ---------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("case", VECTORS["tag_check"], ids=lambda c: c["name"])
def test_the_gpu_tag_check_reproduces_the_vectors(case: dict[str, Any]) -> None:
    import cupy

    own, valid, tables, lens, readers = (cupy.asarray(a) for a in tag_inputs(case))
    got = kernels.tag_check(own, valid, tables, lens, readers, case["page_size"])
    assert cupy.asnumpy(got).tolist() == case["clean"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", VECTORS["checksums"], ids=lambda c: c["name"])
def test_the_gpu_checksums_reproduce_the_vectors(case: dict[str, Any]) -> None:
    k, v = pool_of(case, "cuda")
    got = kernels.page_checksums(k, v, torch.tensor(case["pages"], device="cuda"))
    assert [str(x) for x in got.tolist()] == case["checksums"]


@pytest.mark.gpu
def test_gpu_and_cpu_agree_on_a_large_random_pool() -> None:
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(4, 300, 16, 8, 128, generator=gen).to(torch.bfloat16)
    v = torch.randn(4, 300, 16, 8, 128, generator=gen).to(torch.bfloat16)
    pages = torch.randperm(300, generator=gen)[:200]
    cpu = kernels.page_checksums(k, v, pages)
    gpu = kernels.page_checksums(k.cuda(), v.cuda(), pages.cuda())
    assert np.array_equal(cpu, gpu)


@pytest.mark.gpu
def test_device_tags_follow_the_ledger_by_batched_updates() -> None:
    import cupy

    own = np.zeros(64, np.int32)
    valid = np.zeros(64, np.uint32)
    tags = kernels.DeviceTags()
    tags.sync(own, valid)
    own[[3, 4]], valid[[3, 4]] = 7, 16
    tags.touch([3, 4])
    tags.sync(own, valid)
    assert (
        cupy.asnumpy(tags.own).tolist() == own.tolist()
        and cupy.asnumpy(tags.valid).tolist() == valid.tolist()
    )
    got = kernels.tag_check(
        tags.own, tags.valid, cupy.asarray([[3, 4]]), cupy.asarray([32]), cupy.asarray([7]), 16
    )
    assert cupy.asnumpy(got).tolist() == [True]
    # The guard's step: the pages written since go over with the readers in one copy, and the
    # verdicts come back as 0 (not clean), 1 (clean), 2 (clean: reads nothing).
    own[5], valid[5] = 9, 3
    own[3] = 8  # page 3 now holds request 8's KV: request 7 may no longer read it
    tags.touch([5, 3])
    verdicts = tags.check(
        own, valid, cupy.asarray([[3, 4], [5, 0], [3, 0]]), cupy.asarray([32, 3, 0]), np.array([7, 9, 7]), 16
    )
    assert verdicts.tolist() == [0, 1, 2]
    assert cupy.asnumpy(tags.own).tolist() == own.tolist()


@pytest.mark.gpu
def test_device_tags_check_steps_like_the_host_check() -> None:
    # Steps of random tag changes (some pages touched twice, some out of range) and random
    # batches: the device's verdicts, with the updates applied inside the launch, are the
    # host's on the host's tags, and the device keeps the host's tags between steps.
    import cupy

    rng = np.random.default_rng(11)
    pages, ps = 4096, 16
    own = rng.integers(0, 40, pages).astype(np.int32)
    valid = rng.integers(0, ps + 1, pages).astype(np.uint32)
    tags = kernels.DeviceTags()
    tags.sync(own, valid)
    for step in range(30):
        changed = rng.integers(0, pages, int(rng.integers(0, 600)))
        own[changed] = rng.integers(0, 40, len(changed))
        valid[changed] = rng.integers(0, ps + 1, len(changed))
        tags.touch(changed)
        tags.touch([-1, pages])  # named by a bad event: ignored
        batch = int(rng.integers(0, 64))
        width = int(rng.integers(1, 40))
        readers = rng.integers(0, 40, batch).astype(np.int32)
        lens = rng.integers(0, ps * (width + 1), batch).astype(np.int32)
        # rows made of pages the reader owns (with a few foreign ones), so both verdicts occur
        rows = [rng.choice(np.flatnonzero(own == r) if (own == r).any() else [0], width) for r in readers]
        tables = np.array(rows, np.int32).reshape(batch, width)
        flip = rng.random(tables.shape) < 0.01
        tables[flip] = rng.integers(-2, pages + 2, int(flip.sum()))
        got = tags.check(own, valid, cupy.asarray(tables), cupy.asarray(lens), readers, ps)
        want = check_tags(own, valid, tables, lens, readers, ps)
        assert ((got > 0) == want).all(), f"step {step}"
        assert ((got == 2) == (lens == 0)).all(), f"step {step}"
    assert cupy.asnumpy(tags.own).tolist() == own.tolist()
    assert cupy.asnumpy(tags.valid).tolist() == valid.tolist()
