"""kvguard's vLLM 0.33.0 adapter: `attach()` installs the hooks with a given attachment (or
one made from the environment), `plugin.register` is the `vllm.general_plugins` entry point.
How tenants are read and what each vLLM hook maps to: see `adapter`."""

from kvguard.agents.vllm.adapter import VllmAdapter, attach
from kvguard.agents.vllm.tenants import tenant_reader

__all__ = ["VllmAdapter", "attach", "tenant_reader"]
