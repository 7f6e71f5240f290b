"""The bundled pair on llama.cpp against the same pair on transformers, on the dev suite.

Both runs are `ensemble-llm bench`'s (the same examples, greedy, every method); this compares
them method by method: the pooled accuracy on each backend, the paired-bootstrap 95% interval
of llama.cpp's minus transformers', and how many greedy texts are equal. llama.cpp decodes the
GGUF at its own quantization with int8 activations, transformers the same weights dequantized
to float32, so near ties can turn.

    python benchmarks/llama_quality.py --tasks suite:30 --out benchmarks/results/llama_quality
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PAIR = ("smollm2-135m-instruct", "gemma-3-270m")
METHODS = ["single", "unite", "safe", "specfuse", "smc:n_particles=4"]


def run(backend: str, tasks: list[str], examples: int) -> dict:
    from ensemble_llm.bench import parse_methods, resolve_tasks, run_bench

    models = [{"model": m, "backend": backend} for m in PAIR]
    return run_bench(models, parse_methods(METHODS, 2), resolve_tasks(tasks, examples), speed_prompts=0, progress=False)


def compare(llama: dict, hf: dict) -> dict:
    from ensemble_llm.bench import bootstrap_diff

    out = {}
    tasks = [t for t in llama["hits"] if t in hf["hits"]]
    for label in llama["methods"]:
        a = {t: llama["hits"][t][label] for t in tasks}
        b = {t: hf["hits"][t][label] for t in tasks}
        texts = [(x, y) for t in tasks for x, y in zip(llama["outputs"][t][label], hf["outputs"][t][label])]
        out[label] = {
            "llama_correct": sum(sum(v) for v in a.values()),
            "transformers_correct": sum(sum(v) for v in b.values()),
            "llama_minus_transformers": bootstrap_diff(a, b),
            "texts_equal": sum(x == y for x, y in texts),
            "examples": len(texts),
            "texts_equal_share": round(sum(x == y for x, y in texts) / max(1, len(texts)), 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", nargs="+", default=["suite:30"])
    ap.add_argument("--examples", type=int, default=30)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    runs = {b: run(b, args.tasks, args.examples) for b in ("llama.cpp", "transformers")}
    res = {"args": {"tasks": args.tasks}, "comparison": compare(runs["llama.cpp"], runs["transformers"])}
    args.out.mkdir(parents=True, exist_ok=True)
    for b, r in runs.items():
        (args.out / f"{b}.json").write_text(json.dumps(r, indent=1, default=str))
    (args.out / "results.json").write_text(json.dumps(res, indent=1))
    lines = [
        "# The pair on llama.cpp against transformers, dev suite",
        "",
        f"`python benchmarks/llama_quality.py --tasks {' '.join(args.tasks)}`; greedy, the same examples.",
        "",
        "| method | llama.cpp | transformers | llama.cpp - transformers, points [95%] | greedy texts equal |",
        "|---|---|---|---|---|",
    ]
    for label, c in res["comparison"].items():
        d = c["llama_minus_transformers"]
        lines.append(
            f"| {label} | {c['llama_correct']}/{c['examples']} | {c['transformers_correct']}/{c['examples']} "
            f"| {d['diff']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}] | {c['texts_equal']}/{c['examples']} "
            f"({100 * c['texts_equal_share']:.0f}%) |"
        )
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
