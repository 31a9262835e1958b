"""The daemon: the global ledger over gRPC, the audit store, alert fan-out and kill dispatch."""
