"""The one thing pyproject.toml cannot say: the ledger's C extension needs NumPy's headers."""

import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvguard.ledger._hot",
            ["ledger/_hot.c"],
            include_dirs=[numpy.get_include()],
            extra_compile_args=["-Wall", "-Wextra"],
        )
    ]
)
