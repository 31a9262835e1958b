"""The dashboard's screens, one module each (tui/app.py switches between them)."""
