"""kvguard.testbed: a small but real paged-attention inference engine that reproduces the
cross-tenant KV leak of prefill/decode disaggregated serving (docs/design.md, section 1).

Compute core: :mod:`.paged` (KV page pool, paged decode attention, page export/import and
checksums) and :mod:`.models` (EchoModel, whose responses repeat their context verbatim so a stale
page shows up as another user's text; TinyTransformer, a random-weight decoder for benchmarks).
Invariant: pages are zeroed once when the pool is built and never scrubbed afterwards, and nothing
in the compute core checks page ownership; that is left to kvguard.
"""

from .models import EchoModel, TinyTransformer, TransformerConfig
from .paged import KVPool, dense_attention, page_checksums, paged_attention, prefill_attention, token_slots

__all__ = [
    "EchoModel",
    "KVPool",
    "TinyTransformer",
    "TransformerConfig",
    "dense_attention",
    "page_checksums",
    "paged_attention",
    "prefill_attention",
    "token_slots",
]
