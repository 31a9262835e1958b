"""The dashboard's own widgets: the status lines and the pool map."""
