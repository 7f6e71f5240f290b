"""What the shot exam costs a request (issue 60: at most 10% of its time, cold), and what bounds it.

Each configuration runs in a fresh process: the bundled pair on llama.cpp, one method, the exam
on or off; the first few-shot request after loading is the cold one, the next ones (other
examples of the same tasks) are warm. Rounds alternate on/off so drift hits both alike; the
figure is the median of the per-round ratios on/off of the request's wall time. Fresh processes
on this machine differ by 10-20% from each other, so a second, paired figure runs every prompt
whole (no stored prompts) with the exam on and off in one process per method, in alternating
order, and compares the same requests.

    python benchmarks/exam_cost.py --tasks /tmp/floor/capital_of.jsonl /tmp/dev/plural.jsonl \
        --rounds 3 --out benchmarks/results/exam_cost
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PAIR = ["smollm2-135m-instruct", "gemma-3-270m"]
METHODS = ["unite", "safe", "specfuse", "smc"]
WARM = 4  # warm requests after the cold one


def child(method: str, exam: bool, tasks: list[str]) -> dict:
    from ensemble_llm import Ensemble
    from ensemble_llm.bench import task_prompts

    cfg = {"exam": exam, **({"n_particles": 4} if method == "smc" else {})}
    eng = Ensemble(PAIR, method=method, config=cfg).load()
    prompts = [p for t in tasks for p, _ in task_prompts(Path(t), 1 + WARM, "drawn")]
    times, fired = [], 0
    for prompt in prompts:
        t0 = time.perf_counter()
        res = eng.generate(prompt, raw=True, max_new_tokens=16, stop=["\n"])
        times.append(time.perf_counter() - t0)
        fired += "solo" in res.stats
    cold = [times[k * (1 + WARM)] for k in range(len(tasks))]
    warm = [t for i, t in enumerate(times) if i % (1 + WARM)]
    eng.close()
    return {"cold_s": sum(cold), "warm_s": sum(warm), "fired": fired, "requests": len(times)}


def paired_child(method: str, tasks: list[str], prompts_per_task: int) -> dict:
    """Every prompt run whole (no stored prompts) twice in one process, exam on and off in
    alternating order: paired per request, so the process-to-process drift of this machine
    (10-20% between fresh processes) cancels. Requests where the exam fired (a member ran
    alone) are counted apart: there it saves work instead of costing it."""
    from ensemble_llm import Ensemble
    from ensemble_llm.bench import task_prompts

    cfg = {"exam": True, **({"n_particles": 4} if method == "smc" else {})}
    eng = Ensemble(PAIR, method=method, config=cfg).load()
    for m in eng.members:
        m.prefixes.max_bytes = 0
    prompts = [p for t in tasks for p, _ in task_prompts(Path(t), prompts_per_task, "drawn")]
    pairs = []
    for i, prompt in enumerate(prompts):
        got = {}
        for exam in (True, False) if i % 2 == 0 else (False, True):
            eng._method.config.exam = exam
            t0 = time.perf_counter()
            res = eng.generate(prompt, raw=True, max_new_tokens=16, stop=["\n"])
            got[exam] = (time.perf_counter() - t0, "solo" in res.stats)
        pairs.append({"on_s": got[True][0], "off_s": got[False][0], "fired": got[True][1]})
    eng.close()
    return {"pairs": pairs}


def rows_child(tasks: list[str]) -> dict:
    """What bounds the exam: per member, a prompt's prefill with the exam's scored rows (each gets
    the output layer) against the same prefill with its last row only, alternating, no stored
    prompts reused (the prompts of the tasks, WARM + 1 of each)."""
    from ensemble_llm import Ensemble
    from ensemble_llm.bench import task_prompts
    from ensemble_llm.evidence import _examined, answer_spans, span_groups

    members = Ensemble(PAIR, method="specfuse").load().members
    prompts = [p for t in tasks for p, _ in task_prompts(Path(t), 1 + WARM, "drawn")]
    out = {}
    for m in members:
        m.prefixes.max_bytes = 0
        plain = scored = 0.0
        rows = 0
        for p in prompts * 2:
            ids = m.prompt_ids(p)
            want = [q for g in _examined([span_groups(m, p, ids, answer_spans(p))])[0] for q in g]
            for positions in ([], want) if rows % 2 == 0 else (want, []):
                t0 = time.perf_counter()
                m.score_prompt(ids, positions)
                dt = time.perf_counter() - t0
                m.forget_prompt(ids)
                plain, scored = (plain + dt, scored) if not positions else (plain, scored + dt)
            rows += len(want)
        out[m.name] = {
            "prompts": 2 * len(prompts),
            "rows_per_prompt": round(rows / (2 * len(prompts)), 2),
            "prefill_ms": round(1000 * plain / (2 * len(prompts)), 1),
            "ms_per_scored_row": round(1000 * (scored - plain) / max(1, rows), 2),
        }
    return out


def run_child(method: str, exam: bool | str, tasks: list[str], per_task: int = 0) -> dict:
    arg = exam if isinstance(exam, str) else str(int(exam))
    cmd = [sys.executable, __file__, "--child", method, arg, "--tasks", *tasks, "--per-task", str(per_task)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def markdown(record: dict) -> str:
    lines = [
        "# What the shot exam costs a request",
        "",
        f"`{record['command']}`: each configuration a fresh process; the first request after loading is "
        "cold (its prompt runs whole), the next ones warm. Ratios: exam on over off, median of the rounds. "
        "Paired: in one process per method, no stored prompts, every prompt run with the exam on and "
        "off in alternating order; the ratio over the requests where the exam did not fire.",
        "",
        "| method | cold, on/off | warm, on/off | cold seconds off, on (per round) | requests run alone (on) "
        "| paired, every prompt whole: on/off (sum, median) | paired requests (fired) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in record["methods"].items():
        pairs = ", ".join(f"{x['off']['cold_s']:.2f}/{x['on']['cold_s']:.2f}" for x in r["rounds"])
        fired = sum(x["on"]["fired"] for x in r["rounds"])
        total = sum(x["on"]["requests"] for x in r["rounds"])
        n_fired = sum(x["fired"] for x in r["paired"])
        lines.append(
            f"| {m} | {r['cold_ratio_median']:.3f} | {r['warm_ratio_median']:.3f} | {pairs} | {fired} of {total} "
            f"| {r['paired_ratio']:.3f}, {r['paired_median']:.3f} | {len(r['paired'])} ({n_fired}) |"
        )
    lines += [
        "",
        "What bounds it: a prompt's prefill with the exam's scored rows against the same prefill with "
        "its last row only, per member (no stored prompt reused):",
        "",
        "| member | scored rows per prompt | prefill, last row only (ms) | each scored row (ms) |",
        "|---|---|---|---|",
    ]
    for name, r in record.get("rows", {}).items():
        lines.append(f"| {name} | {r['rows_per_prompt']} | {r['prefill_ms']} | {r['ms_per_scored_row']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", nargs="+", required=True, help="task files with drawn shots (bigbench_split layout)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", nargs=2, metavar=("METHOD", "EXAM"))
    ap.add_argument("--per-task", type=int, default=6, help="prompts per task in the paired run")
    args = ap.parse_args()
    if args.child:
        if args.child[0] == "rows":
            print(json.dumps(rows_child(args.tasks)))
        elif args.child[0] == "paired":
            print(json.dumps(paired_child(args.child[1], args.tasks, args.per_task)))
        else:
            print(json.dumps(child(args.child[0], args.child[1] == "1", args.tasks)))
        return
    results = {}
    for method in args.methods:
        runs = []
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            pair = {exam: run_child(method, exam, args.tasks) for exam in order}
            runs.append({"off": pair[False], "on": pair[True]})
            print(method, r, json.dumps(runs[-1]), flush=True)
        paired = run_child("paired", method, args.tasks, args.per_task)["pairs"]
        quiet = [x for x in paired if not x["fired"]]
        results[method] = {
            "paired": paired,
            "paired_ratio": round(sum(x["on_s"] for x in quiet) / sum(x["off_s"] for x in quiet), 3),
            "paired_median": round(statistics.median(x["on_s"] / x["off_s"] for x in quiet), 3),
            "rounds": runs,
            "cold_ratio_median": round(statistics.median(x["on"]["cold_s"] / x["off"]["cold_s"] for x in runs), 3),
            "warm_ratio_median": round(statistics.median(x["on"]["warm_s"] / x["off"]["warm_s"] for x in runs), 3),
        }
    rows = run_child("rows", False, args.tasks)
    record = {"command": " ".join(sys.argv), "tasks": args.tasks, "pair": PAIR, "methods": results, "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
        (args.out / "results.md").write_text(markdown(record))
    print(json.dumps({m: {k: v for k, v in r.items() if k != "rounds"} for m, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
