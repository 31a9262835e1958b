"""Lazy activation of the import-only stubs for SGLang's CPU CI venv.

Copied into the SGLang venv's site-packages with torchvision_stub.py and triton_stub.py, and
loaded by a one-line `_engine_stubs.pth` (`import engine_stubs_activate`). It costs nothing at
interpreter start: the stubs (which first ask torch and transformers their cached
'is triton / torchvision there?' questions) are installed only when something imports `sglang`.
"""
import importlib.abc
import sys


class _ActivateOnSglang(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sglang":
            sys.meta_path.remove(self)
            import torchvision_stub, triton_stub
            torchvision_stub.install()
            triton_stub.install()
        return None          # let the normal finders load the real module


if not any(type(f).__name__ == "_ActivateOnSglang" for f in sys.meta_path):
    sys.meta_path.insert(0, _ActivateOnSglang())
