"""The HTTP output (`http://`, `https://`): one JSON POST per alert, to an event collector or
a webhook (the encoding's `body`: an OCSF event, kvguard's JSON, or `{"cef": LINE}`).

Invariant: 408, 429 and 5xx mean "not now" (the alert is kept and retried); any other 4xx
means "never" (the alert is rejected: counted, said, skipped), and so does a redirect: it is
never followed (urllib would follow a 302 as a GET without the body and call it delivered), so
an alert goes only where the URL names and is never counted as sent when it was not.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.sinks import fields
from kvguard.sinks.output import (
    DEFAULT_CAPACITY,
    Log,
    Options,
    OutputError,
    QueuedOutput,
    Rejected,
    _stderr,
    tls_context,
)
from kvguard.sinks.registry import Format

TIMEOUT_S = 10.0


def http_body(fmt: Format, alert: svc.Alert) -> bytes:
    return json.dumps(fmt.body(alert), ensure_ascii=False, separators=(",", ":")).encode()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # the 3xx comes back as an HTTPError: rejected, with where it pointed


class HttpOutput(QueuedOutput):
    """POSTs each alert to `url`."""

    def __init__(
        self,
        url: str,
        fmt: Format,
        *,
        headers: dict[str, str] | None = None,
        tls: ssl.SSLContext | None = None,
        capacity: int = DEFAULT_CAPACITY,
        log: Log = _stderr,
    ) -> None:
        super().__init__(url, fmt, capacity, log)
        self.url = url
        self.headers = {"Content-Type": "application/json", "User-Agent": f"kvguard/{fields.VERSION}"}
        self.headers |= headers or {}
        self.tls = tls
        handlers: list[urllib.request.BaseHandler] = [_NoRedirect()]
        if tls is not None:
            handlers.append(urllib.request.HTTPSHandler(context=tls))
        self._opener = urllib.request.build_opener(*handlers)

    def deliver(self, alert: svc.Alert) -> None:
        request = urllib.request.Request(self.url, http_body(self.format, alert), self.headers, method="POST")
        try:
            with self._opener.open(request, timeout=TIMEOUT_S) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            if exc.code in (408, 429) or exc.code >= 500:
                raise OutputError(f"HTTP {exc.code} {exc.reason}") from None
            if 300 <= exc.code < 400:
                raise Rejected(
                    f"HTTP {exc.code} redirect to {exc.headers.get('Location', '?')}, not followed"
                ) from None
            raise Rejected(f"HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise OutputError(f"cannot POST to {self.url}: {reason}") from None


def open_output(url: str, fmt: Format, options: Options) -> HttpOutput:
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"{url}: no host")
    tls = tls_context(options.ca) if parts.scheme == "https" else None
    return HttpOutput(url, fmt, headers=options.headers, tls=tls, capacity=options.capacity, log=options.log)
