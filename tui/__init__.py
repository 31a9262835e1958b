"""`kvguard top`: the terminal dashboard, a client of the daemon's gRPC API only.

Invariant: nothing here imports another kvguard part than `kvguard.proto` (ARCHITECTURE §6):
whatever the dashboard shows, it learnt from the daemon's services, as any other client could.
"""
