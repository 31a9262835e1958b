"""Import-only stand-in for `torchvision` (CPU CI for SGLang's KV classes).

PyPI's torchvision is linked against a CUDA torch and fails beside the local CPU torch
('operator torchvision::nms does not exist'). SGLang imports it at module level in its
multimodal config helpers (srt/configs -> multimodal/internvl_utils.py), never on the KV path.
This installs a sys.meta_path finder that serves an inert module for `torchvision` and every
`torchvision.*`; any attribute is a permissive placeholder. It has no dist-info, so
transformers' is_torchvision_available() stays False. Call install() before importing sglang.
"""
import importlib.abc
import importlib.machinery
import sys
import types


class _Anything:
    def __init__(self, name="torchvision.<stub>"):
        self._name = name
    def __call__(self, *a, **k):
        return _Anything(self._name + "()")
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self._name}.{item}")
    def __getitem__(self, item):
        return _Anything(f"{self._name}[...]")
    def __mro_entries__(self, bases):          # allow `class X(torchvision.Foo)`
        return (object,)
    def __repr__(self):
        return f"<stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None
    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m
    def exec_module(self, module):
        pass


def install():
    # transformers caches (lru_cache) whether torchvision exists; ask it before the stub is
    # visible so it answers False and never routes image processors through the stub.
    try:
        from transformers.utils import import_utils as _iu
        _iu.is_torchvision_available()
    except Exception:
        pass
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
