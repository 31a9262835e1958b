"""The page-ownership ledger and its detectors (one implementation, used by the in-engine
guard and by the daemon)."""
