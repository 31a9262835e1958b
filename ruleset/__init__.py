"""Rules: severity, action and output per finding, loaded from YAML and validated."""
