"""The llama.cpp health check (members/backends/llama_cpp/health.py): the configurations are tried in a child
process, a child that dies of a real SIGSEGV (injected with the test-only ENSEMBLE_LLM_PROBE_FAULT)
leaves this process working, the fallback is chosen or the clear error raised, and the verdict is
kept per machine and build so that the next start probes nothing."""

from __future__ import annotations

import logging

import pytest
from helpers import SMOL

from ensemble_llm import Ensemble
from ensemble_llm.errors import ConfigError
from ensemble_llm.members.backends.llama_cpp import health as llama_health
from ensemble_llm.members.backends.llama_cpp.probe import FAULT_ENV
from ensemble_llm.members.loader import gguf_file, resolve_backend, resolve_source
from ensemble_llm.members.options import MemberOptions
from ensemble_llm.members.sources import Source

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def smol_file():
    """The bundled SmolLM2 GGUF, named by its path (a "gguf" source: no fetch into the test's cache)."""
    path = gguf_file(resolve_source(SMOL), progress=False)
    return path, Source("gguf", str(path), "smol")


def test_a_probe_that_crashes_with_extra_buffer_types_picks_the_next_configuration(smol_file, tmp_path, monkeypatch):
    """Extra buffer types crash (as ggml's AMX path does in some VMs): the verdict takes them off,
    this process loads the member that way and answers greedy text."""
    path, src = smol_file
    monkeypatch.setenv(FAULT_ENV, "extra")
    v = llama_health.verdict(path, tmp_path)
    assert v.extra_bufts is False and v.tried == ("extra buffer types: killed by SIGSEGV", "no extra buffer types: ok")
    assert resolve_backend(src, MemberOptions(), tmp_path) == "llama.cpp"
    with Ensemble([str(path)], method="single", cache_dir=tmp_path, progress=False) as engine:
        member = engine.load()._members[0]
        assert member.runner.extra_bufts is False
        assert engine.generate("The capital of France is", max_new_tokens=4, raw=True).text.strip()


def test_when_every_configuration_crashes_auto_falls_back_and_explicit_llama_cpp_is_refused(
    smol_file, tmp_path, monkeypatch, caplog
):
    path, src = smol_file
    monkeypatch.setenv(FAULT_ENV, "all")
    monkeypatch.setattr(llama_health, "_told", set())
    with caplog.at_level(logging.WARNING, logger="ensemble_llm"):
        assert resolve_backend(src, MemberOptions(), tmp_path) == "transformers"
        assert resolve_backend(src, MemberOptions(), tmp_path) == "transformers"
    lines = [r.getMessage() for r in caplog.records if "llama.cpp crashes" in r.getMessage()]
    assert len(lines) == 1 and "killed by SIGSEGV" in lines[0] and "run on transformers" in lines[0]
    with pytest.raises(ConfigError, match=r"extra buffer types: killed by SIGSEGV; no extra buffer types: killed by"):
        resolve_backend(src, MemberOptions(backend="llama.cpp"), tmp_path)
    with pytest.raises(ConfigError, match="--no-cache-dir"):
        Ensemble([{"model": str(path), "backend": "llama.cpp"}], method="single", cache_dir=tmp_path).load()


def test_the_verdict_is_kept_per_build_and_cpu_and_read_without_a_probe(smol_file, tmp_path, monkeypatch):
    """Once kept, a crashing child is never started again for this build and CPU (the fault set
    now would show); another CPU's flags make another key, probed afresh."""
    path, _ = smol_file
    assert llama_health.verdict(path, tmp_path).extra_bufts is True
    monkeypatch.setenv(FAULT_ENV, "all")
    assert llama_health.verdict(path, tmp_path).extra_bufts is True
    monkeypatch.setattr(llama_health, "cpu_flags", lambda: "flags : another cpu")
    assert not llama_health.verdict(path, tmp_path).healthy
    assert len(list((tmp_path / "llama-health").glob("*.json"))) == 2


def test_a_file_that_does_not_load_says_nothing_of_the_cpu(tmp_path):
    """The load fails with the file's own error, and no verdict is kept from it."""
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(gguf_file(resolve_source(SMOL), progress=False).read_bytes()[:4096])
    v = llama_health.verdict(bad, tmp_path)
    assert v.healthy and "exit code 3" in v.why()
    assert not list((tmp_path / "llama-health").glob("*.json"))
