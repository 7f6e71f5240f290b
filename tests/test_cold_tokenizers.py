"""A cold start reads both members' tokenizers from their GGUFs at once (the members load in
parallel). transformers' GGUF reading imports lazy modules that two threads must not import at the
same time; without the turn-taking in members/convert.py this failed about 2 of 3 fresh processes
("cannot import name 'GGUF_CONFIG_ARCHS'"). Each run is a fresh process: the race is in first imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys, threading
from pathlib import Path
from ensemble_llm.members.convert import extract_tokenizer
from ensemble_llm.members.sources import gguf_file, resolve_source

out, errors = Path(sys.argv[1]), []
paths = {n: gguf_file(resolve_source(n), progress=False) for n in ("smollm2-135m-instruct", "gemma-3-270m")}

def extract(name):
    try:
        extract_tokenizer(paths[name], out / name)
    except Exception as exc:
        errors.append(f"{name}: {type(exc).__name__}: {exc}")

threads = [threading.Thread(target=extract, args=(n,)) for n in paths]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("\\n".join(errors) or "ok")
"""


@pytest.mark.slow
def test_two_members_read_their_gguf_tokenizers_at_once_in_a_fresh_process(tmp_path) -> None:
    for attempt in range(2):
        done = subprocess.run(
            [sys.executable, "-c", PROBE, str(tmp_path / str(attempt))], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == "ok", done.stdout
