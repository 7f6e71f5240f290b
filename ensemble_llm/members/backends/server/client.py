"""The HTTP side of a server member: one pooled connection set per member, small JSON requests.

Every request a server member sends is idempotent (a completion over a prompt given as token ids,
a tokenization), so a refused connection, a timeout or a 5xx is retried with backoff while the
request's deadline allows; then it fails with an error that names the member and the URL.
TCP_NODELAY is set on every socket: without it each small request waited for a delayed ACK.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx

from ....errors import GenerationError
from ...context import check_request, current_deadline

RETRY_WAITS = (0.05, 0.2, 0.5, 1.0, 2.0)  # seconds before each retry, then the last one repeats


class ServerError(GenerationError):
    """A server member's server failed a request (after its retries): the request fails alone."""


class ServerClient:
    """A member's connections to one server: at most `connections` at once, each call bounded by
    `timeout` seconds and by the calling request's deadline."""

    def __init__(self, name: str, url: str, timeout: float, connections: int = 16) -> None:
        self.name, self.url, self.timeout = name, url.rstrip("/"), float(timeout)
        transport = httpx.HTTPTransport(
            retries=0,
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
        )
        self._http = httpx.Client(base_url=self.url, transport=transport, timeout=self.timeout)
        self._lock = threading.Lock()
        self.requests = 0
        self.retries = 0

    def close(self) -> None:
        self._http.close()

    def get(self, path: str) -> Any:
        return self._call("GET", path, None)

    def post(self, path: str, body: dict) -> Any:
        return self._call("POST", path, body)

    def _call(self, method: str, path: str, body: dict | None) -> Any:
        """The JSON answer, retrying what may pass (no answer, 5xx, 503 while loading) with backoff."""
        for attempt in range(len(RETRY_WAITS) + 1):
            check_request()
            wait = self._time_left()
            try:
                r = self._http.request(method, path, json=body, timeout=wait)
            except httpx.TimeoutException as exc:
                problem = f"no answer within {wait:.1f} s ({type(exc).__name__})"
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                with self._lock:
                    self.requests += 1
                if r.status_code < 400:
                    return r.json()
                problem = f"HTTP {r.status_code}: {r.text[:300]}"
                if r.status_code < 500:  # the request itself is wrong: retrying cannot help
                    raise ServerError(self._say(path, problem))
            if attempt == len(RETRY_WAITS) or not self._may_wait(RETRY_WAITS[attempt]):
                raise ServerError(self._say(path, problem))
            with self._lock:
                self.retries += 1
            time.sleep(RETRY_WAITS[attempt])
        raise AssertionError("unreachable")

    def _time_left(self) -> float:
        deadline = current_deadline()
        if deadline is None:
            return self.timeout
        return max(0.05, min(self.timeout, deadline - time.perf_counter()))

    def _may_wait(self, seconds: float) -> bool:
        deadline = current_deadline()
        return deadline is None or time.perf_counter() + seconds < deadline

    def _say(self, path: str, problem: str) -> str:
        return (
            f"member {self.name!r}: the server at {self.url} failed {path} ({problem}); check that it is "
            "running and reachable, or raise the member's timeout."
        )
