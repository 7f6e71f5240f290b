"""Unite at fixed member weights over the dev suite, with both members alone, in one bench run:
how accuracy moves with the weight, task by task. Any weighting rule that gives each task one
weight (the bench's prompts show the same three shots for every example of a task, so the
per-request weights are one per task) can be read off these runs at the nearest weight.

    python benchmarks/weights_grid.py --examples 50 --out benchmarks/results/weights_grid
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ensemble_llm import DEFAULT_MODELS
from ensemble_llm.bench import MethodSpec, resolve_tasks, run_bench, write


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=50)
    ap.add_argument("--grid", type=float, nargs="+", default=[0.2, 0.5, 0.8], help="first member's weights")
    ap.add_argument("--out", default="weights-grid")
    args = ap.parse_args()
    specs = [MethodSpec("single-0", "single", {"member": 0}), MethodSpec("single-1", "single", {"member": 1})]
    specs += [MethodSpec(f"unite-w{w}", "unite", {"weights": [w, 1 - w]}) for w in args.grid]
    res = run_bench(
        list(DEFAULT_MODELS),
        specs,
        resolve_tasks([f"suite:{args.examples}"], args.examples),
        speed_prompts=0,
        progress=False,
    )
    res["command"] = f"python benchmarks/weights_grid.py --examples {args.examples} --out {args.out}"
    write(res, Path(args.out))
    print((Path(args.out) / "results.md").read_text())


if __name__ == "__main__":
    main()
