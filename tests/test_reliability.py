"""Reliability: the watchdog (no request holds the worker past its timeout plus one forward
pass, whatever the method does between yields), retries of internal faults under one deadline,
checks that need no weights at construction, and CLI request errors before loading."""

import json
import os
import time
from pathlib import Path

import pytest

from ensemble_llm import Ensemble, GenerationError, ModelNotFoundError, RequestError, RequestTimeout
from ensemble_llm.members.backends.transformers.member import Member

STORY = "Tell me a long story about a dragon."


@pytest.mark.parametrize(
    "method, config",
    [
        ("single", None),
        ("unite", {"weights": None}),
        ("safe", {"weights": None, "lookahead": 16, "adaptive": False}),
        # one round drafts 48 tokens per member and scores them before the first yield: the engine's
        # check between yields alone would overshoot by a whole round
        ("specfuse", {"weights": None, "segment_len": 48}),
    ],
)
@pytest.mark.slow
def test_watchdog_no_request_outlives_its_timeout_by_more_than_one_forward(tiny_dirs, method, config):
    members = [tiny_dirs["smol"]] if method == "single" else [tiny_dirs["smol"], tiny_dirs["gemma"]]
    eng = Ensemble(members, method=method, config=config).load()
    eng.generate(STORY, max_new_tokens=60)  # one-time costs (vocabulary indexes) out of the timing
    t = time.perf_counter()
    full = eng.generate(STORY, max_new_tokens=60)
    elapsed_full = time.perf_counter() - t
    forwards = sum(v["forward_passes"] for v in full.stats["members"].values())
    per_forward = elapsed_full / forwards
    timeout = elapsed_full / 4
    t = time.perf_counter()
    with pytest.raises(RequestTimeout, match="timeout="):
        eng.generate(STORY, max_new_tokens=60, timeout=timeout)
    held = time.perf_counter() - t
    # one forward pass (with a generous factor for the slowest one) plus scheduling slack, both
    # scaled to this machine's measured speed (a loaded machine is slower at everything)
    assert held <= timeout + 4 * per_forward + max(0.15, 0.1 * elapsed_full), (held, timeout, per_forward)
    again = eng.generate(STORY, max_new_tokens=60)
    assert again.text == full.text  # the engine is intact after the cut


def test_abandoned_stream_runs_no_further_forward(tiny_dirs):
    eng = Ensemble(
        [tiny_dirs["smol"], tiny_dirs["gemma"]], method="specfuse", config={"weights": None, "segment_len": 48}
    ).load()
    stream = iter(eng.stream(STORY, max_new_tokens=300))
    next(stream)
    stream.close()
    before = [m.n_forward for m in eng.members]
    eng.generate("hi", max_new_tokens=2)  # queued behind the abandoned one: runs after it stopped
    after_hi = [m.n_forward for m in eng.members]
    time.sleep(0.2)
    assert [m.n_forward for m in eng.members] == after_hi
    assert sum(after_hi) - sum(before) < 40  # the abandoned request stopped within a forward or so


def _flaky_extend(monkeypatch, fail_at: set[int]):
    """Make Member.extend raise on the given call numbers: a transient device fault, which no
    real input can produce on demand."""
    real = Member.extend
    calls = {"n": 0}

    def extend(self, state, ids, **kw):
        calls["n"] += 1
        if calls["n"] in fail_at:
            raise RuntimeError("simulated device fault")
        return real(self, state, ids, **kw)

    monkeypatch.setattr(Member, "extend", extend)
    return calls


def test_max_retries_retries_an_internal_fault(tiny_dirs, monkeypatch):
    eng = Ensemble([tiny_dirs["smol"]]).load()
    want = eng.generate("hi", max_new_tokens=6)
    calls = _flaky_extend(monkeypatch, {1})
    with pytest.raises(GenerationError, match="simulated device fault"):
        eng.generate("hi", max_new_tokens=6)
    calls["n"] = 0
    got = eng.generate("hi", max_new_tokens=6, max_retries=1)
    assert got.text == want.text and got.stats["retries"] == 1
    calls["n"] = 0
    _flaky_extend(monkeypatch, {1, 2, 3})
    with pytest.raises(GenerationError, match=r"after 2 retries"):
        eng.generate("hi", max_new_tokens=6, max_retries=2)


def test_max_retries_never_repeats_streamed_text(tiny_dirs, monkeypatch):
    eng = Ensemble([tiny_dirs["smol"]]).load()
    _flaky_extend(monkeypatch, {5})  # after a few streamed tokens
    pieces = []
    with pytest.raises(GenerationError, match="simulated"):
        for piece in eng.stream("hi", max_new_tokens=10, max_retries=3):
            pieces.append(piece)
    assert pieces  # text went out, so the fault was not retried (it would repeat that text)


def test_generate_retries_a_fault_after_some_text(tiny_dirs, monkeypatch):
    """generate() shows no deltas, so a fault after a few tokens is still retried (a stream's is not)."""
    eng = Ensemble([tiny_dirs["smol"]]).load()
    want = eng.generate("hi", max_new_tokens=10)
    calls = _flaky_extend(monkeypatch, {5})
    got = eng.generate("hi", max_new_tokens=10, max_retries=1)
    assert calls["n"] > 5 and got.text == want.text and got.stats["retries"] == 1


def test_retries_share_one_deadline(tiny_dirs, monkeypatch):
    eng = Ensemble([tiny_dirs["smol"]]).load()
    real = Member.extend

    def slow_fail(self, state, ids, **kw):
        time.sleep(0.3)
        raise RuntimeError("slow fault")

    monkeypatch.setattr(Member, "extend", slow_fail)
    t = time.perf_counter()
    with pytest.raises((RequestTimeout, GenerationError)):
        eng.generate("hi", max_new_tokens=4, max_retries=50, timeout=1.0)
    assert time.perf_counter() - t < 2.0  # 50 retries of 0.3 s would take 15 s
    monkeypatch.setattr(Member, "extend", real)
    assert eng.generate("hi", max_new_tokens=2).usage.completion_tokens > 0


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, 101])
def test_max_retries_is_checked(tiny_dirs, bad):
    eng = Ensemble([tiny_dirs["smol"]])
    with pytest.raises(RequestError, match="max_retries"):
        eng.check_request("hi", max_retries=bad)


def test_model_folder_without_weights_or_tokenizer_fails_at_construction(tmp_path, tiny_dirs):
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(open(os.path.join(tiny_dirs["smol"], "config.json")).read())
    (no_weights / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="no weights"):
        Ensemble([str(no_weights)])
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for f in ("config.json", "model.safetensors"):
        os.link(os.path.join(tiny_dirs["smol"], f), no_tok / f)
    with pytest.raises(ModelNotFoundError, match="no tokenizer files"):
        Ensemble([str(no_tok)])


def test_non_gguf_file_fails_at_construction(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"<html>404</html>")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        Ensemble([str(bad)])


def test_failed_gguf_conversion_is_remembered_until_the_file_changes(tmp_path):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 40)  # the magic, then nothing usable
    cache = tmp_path / "cache"
    with pytest.raises(ModelNotFoundError, match="could not read"):  # on llama.cpp: its tokenizer is unreadable
        Ensemble([str(bad)], cache_dir=str(cache)).load()
    bad = {"model": str(bad), "backend": "transformers"}  # converted: the verdict is remembered
    eng = Ensemble([bad], cache_dir=str(cache))
    with pytest.raises(ModelNotFoundError, match="could not read") as first:
        eng.load()
    assert "earlier attempt" not in str(first.value)
    verdicts = list((cache / "converted").glob(".*.failed.json"))
    assert len(verdicts) == 1 and "could not read" in json.loads(verdicts[0].read_text())["error"]
    with pytest.raises(ModelNotFoundError, match="earlier attempt on this unchanged file"):
        Ensemble([bad], cache_dir=str(cache)).load()
    time.sleep(0.01)
    Path(bad["model"]).write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x01" * 40)  # changed: tried again
    with pytest.raises(ModelNotFoundError) as third:
        Ensemble([bad], cache_dir=str(cache)).load()
    assert "earlier attempt" not in str(third.value)


@pytest.mark.parametrize(
    "argv, phrase",
    [
        (["generate", "   "], "prompt is empty"),
        (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", "hi", "--temperature", "inf"], "temperature"),
        (["generate", "hi", "--method", "smc", "--temperature", "-1"], "temperature"),
    ],
)
def test_cli_request_errors_come_before_loading(tiny_dirs, capsys, argv, phrase):
    from ensemble_llm.cli import main

    assert main(argv + ["--models", f"{tiny_dirs['smol']},{tiny_dirs['gemma']}"]) == 2
    err = capsys.readouterr().err
    assert phrase in err and "models ready" not in err
