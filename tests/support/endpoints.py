"""An HTTP endpoint host for the probes' tests: it serves the documents an engine's server
would (the engines' own output, made in their venvs), each path with its status and body."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer


def serve(routes: dict[str, tuple[int, str]]) -> tuple[HTTPServer, str]:
    """A host answering each path of `routes` with (status, body), and 404 elsewhere, as the
    engines' FastAPI servers do; `routes` may change while it serves. (The server, its URL.)"""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = routes.get(self.path, (404, '{"detail": "Not Found"}'))
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    http = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    return http, f"http://127.0.0.1:{http.server_address[1]}"
