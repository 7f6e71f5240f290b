"""close() hands the members' freed memory back to the OS. A member's tokenizer is built in a
loader thread (in that thread's glibc arena) and freed by the closing thread; freed under
`_HeapReturn`, as close() frees members, it leaves the process's resident set. Each reading runs
in a fresh process, so that no earlier test's allocations or malloc settings blur it; glibc only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ensemble_llm.members.loader import _HeapReturn

PROBE = """
import gc, json, sys, threading
from contextlib import nullcontext
from ensemble_llm.members.convert import load_cached_tokenizer
from ensemble_llm.members.loader import _HeapReturn

def resident_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024

from transformers import PreTrainedTokenizerFast  # noqa: F401 - imported before the reading

if sys.argv[2] == "build":  # the cached tokenizer, built once, beforehand
    load_cached_tokenizer(sys.argv[1])
    sys.exit()
gc.collect()
before = resident_mib()
held = []
loader = threading.Thread(target=lambda: held.append(load_cached_tokenizer(sys.argv[1])))
loader.start()
loader.join()
loaded = resident_mib()
with _HeapReturn() if sys.argv[2] == "heap-return" else nullcontext():
    held.clear()
    gc.collect()
print(json.dumps({"before": before, "loaded": loaded, "freed": resident_mib()}))
"""


def _readings(folder, how: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(folder), how], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_tokenizer_a_loader_thread_built_leaves_the_resident_set_once_freed(tokenizer_dirs) -> None:
    if _HeapReturn().libc is None:
        pytest.skip("not glibc: nothing to hand back")
    from helpers import GEMMA

    subprocess.run([sys.executable, "-c", PROBE, str(tokenizer_dirs[GEMMA]), "build"], check=True)
    r = _readings(tokenizer_dirs[GEMMA], "heap-return")
    assert r["loaded"] - r["before"] > 150, r  # Gemma's 262k-token tokenizer is resident while held
    assert r["freed"] - r["before"] < 25, r
