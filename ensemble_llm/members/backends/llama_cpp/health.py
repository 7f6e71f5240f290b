"""Which llama.cpp configuration this CPU and this build of llama-cpp-python survive, learnt in a
child process before this process first loads the binding, and kept in the cache.

Why: a native crash cannot be caught, and it takes the user's whole application with it. Some CPUs
advertise instructions their virtual machine does not let a process use: ggml's AMX kernels fault
on `ldtilecfg` in such VMs, and a wheel built with native flags and reused from pip's cache on
another CPU dies of SIGILL. So the configurations are tried in a child (probe.py), fastest
first: llama.cpp's extra buffer types on (AMX, repacked weights), then off. The verdict is kept under
`<cache>/llama-health/`, keyed by the binding's version, its shared libraries and the CPU's flags:
the check runs once per machine and build, and a warm start only reads a small file. Ray actors and
`serve` load members through the same code, so they read the same verdict.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from ...fetch import cache_root

CONFIGS = (("extra buffer types", True), ("no extra buffer types", False))  # fastest first
PROBE_TIMEOUT = 300  # seconds for one child to load and decode a small model
FIX = (
    "reinstall llama-cpp-python without native CPU flags and without pip's cached wheel: "
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" '
    "pip install --force-reinstall --no-cache-dir llama-cpp-python (docs/members.md), or give the member "
    "backend='transformers'"
)
_log = logging.getLogger("ensemble_llm")
_told: set[str] = set()  # verdict keys whose fallback this process has reported (one line each)


@dataclass(frozen=True)
class Verdict:
    """The configuration that works (`extra_bufts`), or None when none did; what each try gave."""

    extra_bufts: bool | None
    tried: tuple[str, ...]
    key: str = ""

    @property
    def healthy(self) -> bool:
        return self.extra_bufts is not None

    def why(self) -> str:
        return "; ".join(self.tried)


def installed() -> bool:
    """Whether llama-cpp-python is installed, without importing it (an import can already crash)."""
    return importlib.util.find_spec("llama_cpp") is not None


def cpu_flags() -> str:
    """The CPU's model and feature flags (Linux), else what `platform` tells."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f.read(1 << 16).splitlines() if ln.startswith(("flags", "model name"))]
        if lines:
            return "\n".join(lines[:2])
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def build_key() -> str:
    """The binding's version, its shared libraries (name, size, time) and the CPU, as one digest."""
    spec = importlib.util.find_spec("llama_cpp")
    folder = Path(spec.origin).parent if spec and spec.origin else Path(".")
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    libs = [p for p in sorted(folder.rglob("*")) if p.suffix in (".so", ".dylib", ".dll") or ".so." in p.name]
    files = [f"{p.relative_to(folder)}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for p in libs]
    text = "\n".join([version, platform.machine(), cpu_flags(), *files])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


LOAD_FAILED = 3  # probe.py's exit code when the file does not load: the file's fault, not the CPU's


def probe(gguf: Path, extra_bufts: bool) -> tuple[str | None, bool]:
    """(None, True) when a child loads `gguf` and decodes with this configuration; else what
    happened, and whether it says anything of this CPU and build (a file that does not load, or a
    child that did not finish in time on a loaded machine, says nothing: not kept)."""
    script = Path(__file__).with_name("probe.py")
    # -P: the script's folder is not put on sys.path (a module named like the binding would shadow it)
    cmd = [sys.executable, "-P", str(script), str(gguf), "1" if extra_bufts else "0"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"no answer in {PROBE_TIMEOUT} s", False
    if done.returncode == 0 and done.stdout.strip().endswith("ok"):
        return None, True
    if done.returncode < 0:
        try:
            return f"killed by {signal.Signals(-done.returncode).name}", True
        except ValueError:
            return f"killed by signal {-done.returncode}", True
    last = [ln for ln in done.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
    return f"exit code {done.returncode}: {last[0].strip()[:300]}", done.returncode != LOAD_FAILED


def verdict(gguf: Path, cache_dir=None) -> Verdict:
    """This machine's and build's verdict: read from the cache, else probed with `gguf` (a small
    GGUF: the member's own) and stored. One process probes at a time; the others wait and read.
    A probe that says nothing of the CPU (`probe`) is not kept, and lets the load go on: it fails
    there with its own error, or works."""
    key = build_key()
    path = cache_root(cache_dir) / "llama-health" / f"{key}.json"
    found = _read(path, key)
    if found is not None:
        return found
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        found = _read(path, key)
        if found is not None:
            return found
        tried, chosen = [], None
        for name, extra in CONFIGS:
            outcome, conclusive = probe(gguf, extra)
            tried.append(f"{name}: {outcome or 'ok'}")
            if not conclusive:
                return Verdict(extra, tuple(tried), key)
            if outcome is None:
                chosen = extra
                break
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"extra_bufts": chosen, "tried": tried, "model": str(gguf)}, indent=1))
        tmp.replace(path)
    return Verdict(chosen, tuple(tried), key)


def _read(path: Path, key: str) -> Verdict | None:
    try:
        raw = json.loads(path.read_text())
        return Verdict(raw["extra_bufts"], tuple(raw["tried"]), key)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def unhealthy_error(v: Verdict, ref: str):
    """The ConfigError of a member that asks for llama.cpp where no configuration survives."""
    from ....errors import ConfigError

    return ConfigError(
        f"member {ref!r}: llama.cpp crashes on this CPU with this build of llama-cpp-python (checked in a child "
        f"process: {v.why()}), so it is not loaded here. Fix: {FIX}."
    )


def tell_fallback(v: Verdict, ref: str) -> None:
    """One line, once per process and verdict, on why GGUF members run on transformers."""
    if v.key in _told:
        return
    _told.add(v.key)
    _log.warning(
        "ensemble_llm: llama.cpp crashes on this CPU with this build of llama-cpp-python (%s); GGUF members such "
        "as %r run on transformers instead. Fix: %s.",
        v.why(),
        ref,
        FIX,
    )
