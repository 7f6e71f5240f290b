"""The report of a bench run on one half of the frozen BIG-bench split (bigbench_split.py).

Reads an `ensemble-llm bench` results.json (tasks scored with --shots drawn or fixed; methods
with their default weights and, labelled `<method>:weights=None`, with uniform weights) and
writes report.json and report.md beside it:
- every method pooled, with the paired-bootstrap 95% interval of its difference to the best
  member (the better one pooled), to the per-task router (the better member on each task) and,
  for each method run both ways, of its default weights to uniform weights;
- per task, each method against that task's best member, with the task's own interval;
- the same pooled figures on the tasks where the best member gets at least `--floor` of the
  examples right (the other tasks, where every member is at the floor, tie at 0 and only dilute).

    python benchmarks/split_report.py benchmarks/results/outside_drawn/results.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ensemble_llm.bench import bootstrap_diff


def singles_of(hits: dict, tasks: list[str]) -> list[str]:
    return [k for k in hits[tasks[0]] if k.startswith("single-")]


def best_and_router(hits: dict, tasks: list[str]) -> tuple[str, dict]:
    singles = singles_of(hits, tasks)
    best = max(singles, key=lambda k: (sum(sum(hits[t][k]) for t in tasks), k))
    router = {t: hits[t][max(singles, key=lambda k: (sum(hits[t][k]), k))] for t in tasks}
    return best, router


def pooled(hits: dict, tasks: list[str]) -> dict:
    """Every method pooled over `tasks`: correct, and its intervals against the best member, the
    router and (for a method run both ways) its uniform-weights run."""
    if not tasks:
        return {"tasks": 0, "examples": 0, "best_single": None, "router_correct": 0, "oracle_correct": 0, "methods": {}}
    best, router = best_and_router(hits, tasks)
    labels = list(hits[tasks[0]])
    out = {"tasks": len(tasks), "examples": sum(len(hits[t][labels[0]]) for t in tasks), "best_single": best}
    out["router_correct"] = sum(sum(v) for v in router.values())
    out["oracle_correct"] = sum(max(xs) for t in tasks for xs in zip(*(hits[t][s] for s in singles_of(hits, tasks))))
    rows = {}
    for k in labels:
        mine = {t: hits[t][k] for t in tasks}
        row = {"correct": sum(sum(v) for v in mine.values())}
        if not k.startswith("single-"):
            row["vs_best"] = bootstrap_diff(mine, {t: hits[t][best] for t in tasks})
            row["vs_router"] = bootstrap_diff(mine, router)
            uniform = f"{k}:weights=None"
            if uniform in labels:
                row["default_vs_uniform"] = bootstrap_diff(mine, {t: hits[t][uniform] for t in tasks})
        rows[k] = row
    out["methods"] = rows
    return out


def per_task(hits: dict, tasks: list[str]) -> dict:
    out = {}
    for t in tasks:
        singles = singles_of(hits, [t])
        best = max(singles, key=lambda k: (sum(hits[t][k]), k))
        row = {"examples": len(hits[t][best]), "best_single": best, "correct": {k: sum(v) for k, v in hits[t].items()}}
        row["vs_best"] = {
            k: bootstrap_diff({t: v}, {t: hits[t][best]}) for k, v in hits[t].items() if not k.startswith("single-")
        }
        out[t] = row
    return out


def report(results: dict, floor: float) -> dict:
    few_shot = set((results.get("comparison") or {}).get("tasks", results["hits"]))  # chat tasks aside
    hits = {t: h for t, h in results["hits"].items() if t in few_shot}
    tasks = sorted(hits)
    informative = [
        t
        for t in tasks
        if max(sum(hits[t][s]) for s in singles_of(hits, [t])) >= floor * len(next(iter(hits[t].values())))
    ]
    return {
        "shots": results.get("shots"),
        "models": results.get("models"),
        "all_tasks": pooled(hits, tasks),
        "informative_tasks": {"floor": floor, "tasks_list": informative, **pooled(hits, informative)},
        "per_task": per_task(hits, tasks),
    }


def _ci(d: dict) -> str:
    return f"{d['diff']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]"


def markdown(rep: dict, title: str) -> str:
    lines = [f"# {title}", "", f"Shots: {rep['shots']}. Members: {rep['models']}.", ""]
    parts = (("all_tasks", "All tasks"), ("informative_tasks", "Tasks where the best member is off the floor"))
    for key, name in parts:
        p = rep[key]
        lines += [
            f"## {name}: {p['tasks']} tasks, {p['examples']} examples",
            "",
            f"Best member pooled: {p['best_single']}; per-task router {p['router_correct']}; either member right "
            f"(oracle) {p['oracle_correct']}.",
            "",
            "| method | correct | vs best member, points [95%] | vs router | default vs uniform weights |",
            "|---|---|---|---|---|",
        ]
        for k, r in p["methods"].items():
            cells = [_ci(r[x]) if x in r else "" for x in ("vs_best", "vs_router", "default_vs_uniform")]
            lines.append(f"| {k} | {r['correct']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Per task (each method against the task's best member)", ""]
    labels = list(next(iter(rep["per_task"].values()))["correct"])
    lines += ["| task | n | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    for t, r in rep["per_task"].items():
        cells = []
        for k in labels:
            c = str(r["correct"][k])
            if k in r["vs_best"]:
                c += f" ({_ci(r['vs_best'][k])})"
            cells.append(c)
        lines.append(f"| {t} | {r['examples']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", type=Path)
    ap.add_argument("--floor", type=float, default=0.1)
    ap.add_argument("--title", default="Frozen BIG-bench split")
    args = ap.parse_args()
    rep = report(json.loads(args.results.read_text()), args.floor)
    (args.results.parent / "report.json").write_text(json.dumps(rep, indent=1))
    (args.results.parent / "report.md").write_text(markdown(rep, args.title))
    print(markdown(rep, args.title))


if __name__ == "__main__":
    main()
