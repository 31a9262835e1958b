"""Import-only stand-in for `triton` (saves the ~1 GB triton wheel in CPU CI for SGLang).

SGLang imports triton at module level (srt/utils/common.py, mem_cache/memory_pool.py, ...)
and defines @triton.jit kernels there; on CPU (supports_triton=False) the KV classes take
their pure-torch *_naive paths and never launch one. torch must NOT see this stub: install()
first asks torch (functools.cache) whether triton exists, so torch keeps answering False.
A stub kernel raises if launched, so a path that really needs triton fails loudly.
"""
import importlib.abc
import importlib.machinery
import math
import sys
import types

__version__ = "3.9.0"


class _Anything:
    def __init__(self, name):
        self._name = name
    def __call__(self, *a, **k):
        return _Anything(self._name + "()")
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self._name}.{item}")
    def __getitem__(self, item):
        return _Anything(f"{self._name}[...]")
    def __mro_entries__(self, bases):
        return (object,)
    def __repr__(self):
        return f"<triton stub {self._name}>"


class JITFunction:
    def __init__(self, fn, **kw):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)
    def __getitem__(self, grid):
        return self.run
    def run(self, *a, **k):
        raise RuntimeError(f"triton stub: kernel {self.__name__} cannot run (no triton in this venv)")
    __call__ = run


def jit(fn=None, **kw):
    if fn is None:
        return lambda f: JITFunction(f, **kw)
    return JITFunction(fn, **kw)


def _passthrough_decorator(*a, **k):
    return lambda f: f


class Config:
    def __init__(self, *a, **k):
        self.args, self.kwargs = a, k


_SPECIAL = {
    "jit": jit, "autotune": _passthrough_decorator, "heuristics": _passthrough_decorator,
    "Config": Config, "JITFunction": JITFunction, "__version__": __version__,
    "cdiv": lambda x, y: (x + y - 1) // y,
    "next_power_of_2": lambda n: 1 if n <= 1 else 2 ** math.ceil(math.log2(n)),
}
_classes = {}


class _NoDriver:
    """What real triton does on a machine without a GPU: asking for the driver raises."""
    def __getattr__(self, item):
        raise RuntimeError("0 active drivers ([]). There should only be one. (triton stub)")


_SUBMODULES = {"runtime", "language", "compiler", "backends", "testing", "tools", "extra", "jit"}


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if self.__name__ == "triton.runtime" and item == "driver":
            return _NoDriver()
        if item in _SUBMODULES and not (self.__name__ == "triton" and item == "jit"):
            import importlib
            return importlib.import_module(f"{self.__name__}.{item}")
        if item in _SPECIAL:
            return _SPECIAL[item]
        if item.startswith("__"):
            raise AttributeError(item)
        if item[:1].isupper() or item == "constexpr":     # types: real classes (isinstance works)
            key = f"{self.__name__}.{item}"
            if key not in _classes:
                _classes[key] = type(item, (), {"__module__": self.__name__,
                                                "__init__": lambda s, *a, **k: None})
            return _classes[key]
        return _Anything(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "triton" or fullname.startswith("triton."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None
    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m
    def exec_module(self, module):
        pass


def install():
    try:
        import torch.utils._triton as t
        t.has_triton_package(); t.has_triton()
    except Exception:
        pass
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
