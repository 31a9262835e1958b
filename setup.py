"""The one thing pyproject.toml cannot say: the C extensions, one per job, each needing NumPy's
headers and the wire format's reader (proto/wire.h)."""

import numpy
from setuptools import Extension, setup


def extension(name: str, *sources: str) -> Extension:
    return Extension(
        name,
        list(sources),
        include_dirs=[numpy.get_include(), "proto", "ledger"],
        depends=["proto/wire.h", "proto/encode.h", "ledger/pages.h"],
        extra_compile_args=["-Wall", "-Wextra"],
    )


setup(
    ext_modules=[
        extension(
            "kvguard.proto._wire", "proto/_wire.c", "proto/encode.c"
        ),  # events read from and written to bytes
        extension(
            "kvguard.ledger._pages", "ledger/_pages.c", "ledger/runs.c", "ledger/tags.c"
        ),  # the ledger's loops over pages
        extension("kvguard.daemon._rows", "daemon/_rows.c"),  # the audit store's rows of a batch
    ]
)
