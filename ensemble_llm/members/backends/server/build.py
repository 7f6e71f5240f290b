"""A `llama-server` to run members in: found, or built once from the llama.cpp sources that the
llama-cpp-python sdist vendors, and started on loopback (`launch`, for tests, benches and users
without a server of their own).

    python -m ensemble_llm.members.backends.server.build      # prints the binary's path, building it if needed

The build takes the same CPU flags as the README's install (no native flags: on CPUs whose newest
instructions fault under a VM, a native build crashes), the server only (no web UI, no TLS), and
lands in the cache (`~/.cache/ensemble_llm/llama-server/<version>/`), so it runs once a machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Iterator, Sequence

import httpx

from ....errors import ConfigError
from ...fetch import cache_root

CPU_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON")
SERVER_ONLY = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)


def sdist_version() -> str:
    """The llama-cpp-python release whose vendored llama.cpp the server is built from: the installed one."""
    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return "0.3.36"


def llama_server(cache_dir=None, build: bool = True) -> Path:
    """$ENSEMBLE_LLM_LLAMA_SERVER, else the cached build, else one built now (`build`), else an error."""
    given = os.environ.get("ENSEMBLE_LLM_LLAMA_SERVER")
    if given:
        return Path(given)
    out = cache_root(cache_dir) / "llama-server" / sdist_version() / "llama-server"
    if out.is_file():
        return out
    if not build:
        raise ConfigError(f"no llama-server at {out}; run `python -m ensemble_llm.members.backends.server.build`.")
    _build(out)
    return out


def _build(out: Path) -> None:
    """pip downloads the sdist (a package registry is all it needs); cmake builds its server target."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise ConfigError(f"building llama-server needs {tool}, which is not installed (apt install cmake g++).")
    with tempfile.TemporaryDirectory() as tmp:
        spec = f"llama-cpp-python=={sdist_version()}"
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", tmp, spec]
        subprocess.run(pip, check=True)
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        shutil.unpack_archive(str(archive), tmp)
        src = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = Path(tmp) / "build"
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), *CPU_FLAGS, *SERVER_ONLY], check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_suffix(".part")
        shutil.copy2(build / "bin" / "llama-server", part)
        part.replace(out)  # whole or absent


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch(gguf: str | Path, port: int | None = None, args: Sequence[str] = (), wait_s: float = 120.0) -> Iterator[str]:
    """A llama-server over `gguf` on 127.0.0.1 for the block; yields its URL. `args`: more
    llama-server flags (--parallel N, -c N, -t N ...)."""
    proc, url = start(gguf, port, args, wait_s)
    try:
        yield url
    finally:
        stop(proc)


def start(gguf: str | Path, port: int | None, args: Sequence[str] = (), wait_s: float = 120.0):
    """(the process, its URL) once its /health answers; the process is the caller's to `stop`."""
    port = port or free_port()
    cmd = [str(llama_server()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *args]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
    while time.monotonic() - t0 < wait_s:
        if proc.poll() is not None:
            log.seek(0)
            raise ConfigError(f"llama-server exited ({proc.returncode}): {log.read()[-2000:].decode(errors='replace')}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return proc, url
        time.sleep(0.2)
    stop(proc)
    raise ConfigError(f"llama-server on {url} did not answer /health within {wait_s:g} s")


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    print(llama_server())
