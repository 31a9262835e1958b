"""Node agent, in-engine guard, engine adapters and config probes."""
