"""The alert feed to SIEMs: encoders of the daemon's alerts (OCSF Detection Finding, CEF,
JSON lines, RFC 5424 syslog framing) and the outputs that carry them (syslog over UDP, TCP
and TLS, HTTP POST, a file), run by `kvguard alerts` as a client of the daemon.

Invariant: each module here encodes or carries an alert (kvguard.v1.Alert) and nothing else;
none of them reads the audit store or the daemon's state, so a slow or dead output can cost
its own queued alerts (counted, and said in-band) but never the daemon's record of them.
"""
