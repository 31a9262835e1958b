"""A testbed cluster as a context manager, for tests and the demo: `kvguard testbed up` in a
child process, an HTTP client for its OpenAI-compatible API, and the guards' findings.

Invariant: the cluster's processes end with the context (and with the test that made them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


class Cluster:
    def __init__(
        self, audit_dir: str | Path, *, faults: tuple[str, ...] = (), guard: str = "off", **options: Any
    ):
        self.audit_dir = Path(audit_dir)
        self.last_receipt = ""  # the kvguard-receipt header of the last response (post)
        self.args = ["--port", "0", "--guard", guard, "--audit-dir", str(self.audit_dir)]
        for fault in faults:
            self.args += ["--fault", fault]
        for name, value in options.items():
            flag = "--" + name.replace("_", "-")
            if value is False:
                continue  # a switch left off
            if value is True:
                self.args.append(flag)
            elif isinstance(value, dict):
                for key, text in value.items():
                    self.args += [flag, f"{key}={text}"]
            else:
                self.args += [flag, str(value)]
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Cluster:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvguard", "testbed", "up", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.proc.kill()
            err, _ = self.proc.communicate()[1], self.proc.wait()
            raise RuntimeError(f"testbed did not start: {line!r} {err[-2000:]}")
        ready = json.loads(line[6:])
        self.url = ready["url"]
        self.pids: dict[str, int] = ready["pids"]  # node -> its worker process
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        try:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=20)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log = self.proc.stderr.read() if self.proc.stderr else ""
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

    def post(self, path: str, body: dict[str, Any], tenant: str | None = None) -> tuple[int, dict[str, Any]]:
        """(status, body) of a POST; the response's kvguard-receipt header, if it has one, in
        `last_receipt`."""
        headers = {"Content-Type": "application/json"}
        if tenant is not None:
            headers["Authorization"] = f"Bearer {tenant}"
        request = urllib.request.Request(self.url + path, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                self.last_receipt = response.headers.get("kvguard-receipt", "")
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            self.last_receipt = err.headers.get("kvguard-receipt", "")
            return err.code, json.loads(err.read() or b"{}")

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return response.status, json.loads(response.read())

    def complete(self, tenant: str, prompt: str, max_tokens: int | None = None) -> tuple[int, dict[str, Any]]:
        body: dict[str, Any] = {"model": "kvguard-echo", "prompt": prompt}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        return self.post("/v1/completions", body, tenant)

    @staticmethod
    def text(reply: dict[str, Any]) -> str:
        return reply["choices"][0]["text"] if "choices" in reply else ""

    def findings(self) -> list[dict[str, Any]]:
        """Every finding of both workers' guards so far (their captures are flushed too)."""
        return self.post("/admin/flush", {})[1]["findings"]
