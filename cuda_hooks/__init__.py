"""Checks at GPU speed and witnesses outside the engine: GPU kernels for the guard, and the
probes (eBPF, LD_PRELOAD shim) that observe what an engine process moves."""
