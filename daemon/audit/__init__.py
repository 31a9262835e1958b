"""Reading the audit log: from a store directly or from a daemon (`source`), as tables and
JSON Lines (`format`), and a tenant's exposure to a leak (`exposure`)."""
