"""kvguard: makes sure no LLM inference request reads, or is sent, KV-cache data that belongs
to someone else. The repository root is this package; each top-level folder is one part
(docs/design.md): proto (the wire), ledger (page ownership and detectors),
ruleset (severity, action and output per finding), and the services built on them."""

__version__ = "0.1.0"
