"""Helpers the tests share (import them from here, not from conftest)."""

from __future__ import annotations

import os

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma-3-270m"


def start_server(
    models: list[str],
    method: str,
    api_key: str | None = None,
    max_queue: int = 64,
    timeout: float = 240.0,
    extra: list[str] = (),
):
    """`ensemble-llm serve` in a real process on a free 127.0.0.1 port; returns (process, base URL)
    once /health answers. The caller terminates the process."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = (
        [
            sys.executable,
            "-m",
            "ensemble_llm",
            "serve",
            "--models",
            ",".join(models),
            "--method",
            method,
            "--port",
            str(port),
            "--max-queue",
            str(max_queue),
        ]
        + (["--api-key", api_key] if api_key else [])
        + list(extra)
    )
    proc = subprocess.Popen(
        cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited:\n" + proc.stdout.read())
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server did not come up in {timeout:.0f} s")
