"""HTTP plumbing of `serve` (serve.py): the API key (`check_key`, constant-time), the body read
in chunks under its size limit (`body_bytes`: JSON only, 413 past the limit), and the Host header
check against DNS rebinding (`HostCheck`, `allowed_hosts`)."""

from __future__ import annotations

import secrets

from starlette.responses import JSONResponse

from .serve_requests import ApiError, Served

API_KEY_ENV = "ENSEMBLE_LLM_API_KEY"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def key_ok(srv: Served, request) -> bool:
    if srv.api_key is None:
        return True
    auth = request.headers.get("authorization", "")
    # constant-time comparison: the time a wrong key takes says nothing about the right one
    return secrets.compare_digest(auth.encode(), f"Bearer {srv.api_key}".encode())


def check_key(srv: Served, request) -> None:
    if not key_ok(srv, request):
        raise ApiError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            "authentication_error",
            None,
            "invalid_api_key",
        )


async def body_bytes(request, limit: int) -> bytes:
    """The raw body of a POST: JSON only (415 otherwise), read in chunks and refused with 413 as
    soon as it passes `limit` bytes, whatever Content-Length claims."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        # a browser page may send text/plain or a form to any site without asking first (a CORS
        # "simple" request): refusing every other type keeps such posts from driving the models
        raise ApiError(
            415,
            f"the body must be JSON sent as 'Content-Type: application/json' (got {media or 'no content type'!r})",
            param="content-type",
            code="unsupported_media_type",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            await _drain(request, 16 * limit)  # so the client reads the 413 instead of a reset connection
            raise ApiError(
                413,
                f"the request body is larger than this server takes ({limit} bytes); send a shorter prompt "
                "(or start the server with a larger --max-body-mb)",
                code="request_too_large",
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(request, cap: int) -> None:
    """Read and drop the rest of a refused body, up to `cap` bytes (past that the connection just closes)."""
    seen = 0
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > cap:
                return
    except Exception:  # noqa: BLE001 - the client went away: nothing left to drain
        return


class HostCheck:
    """Starlette's `TrustedHostMiddleware` (its Host parsing and name patterns), answering a Host
    outside `allowed` with 421 Misdirected Request and an OpenAI-shaped body instead of its plain
    400. A page on another site that rebinds its DNS name to this machine sends its own name as
    Host, so it is refused here. /health answers any Host (probes address a pod by its IP)."""

    def __init__(self, app, allowed: list[str]) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send) -> None:
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        if scope["type"] not in ("http", "websocket") or scope.get("path") == "/health":
            await self.app(scope, receive, send)
            return

        async def allowed(scope_, receive_, _send) -> None:  # the check let it through: the app answers
            await self.app(scope_, receive_, send)

        async def misdirected(message) -> None:  # the check refused it (its only reply): 421 instead
            if message["type"] == "http.response.start":
                host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
                err = ApiError(
                    421,
                    f"this server does not answer for the Host {host!r:.100}; start it with --allowed-host NAME "
                    f"for each name its clients use (allowed now: {', '.join(self.allowed)})",
                    code="misdirected_request",
                )
                await JSONResponse(err.body(), status_code=421)(scope, receive, send)

        check = TrustedHostMiddleware(allowed, allowed_hosts=self.allowed, www_redirect=False)
        await check(scope, receive, misdirected)


def allowed_hosts(host: str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The Host names a server bound to `host` answers for: loopback names, the bound address
    (not a wildcard such as 0.0.0.0, which no client sends) and `extra` (`--allowed-host`)."""
    names = list(LOOPBACK_HOSTS)
    if host not in ("0.0.0.0", "::", ""):
        names.append(f"[{host}]" if ":" in host and not host.startswith("[") else host)
    return list(dict.fromkeys(n.lower() for n in [*names, *extra]))
