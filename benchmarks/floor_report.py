"""The report of bench runs on the floor tasks (issue 60; floor_tasks.py), one folder per task.

Merges the runs (each `ensemble-llm bench` results.json: the single members and the methods on
one task) and writes report.json and report.md into --out:
- split_report.py's tables: every method pooled against the best member and the per-task router,
  with paired-bootstrap 95% intervals, and per task;
- what each method keeps of the better member's right answers (per task, the member with more),
  pooled over the tasks and per task: the issue's 90% line.

    python benchmarks/floor_report.py RUNS_DIR --tasks capital_of ... --title T --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from split_report import markdown, report, singles_of  # noqa: E402


def merge(folder: Path, tasks: list[str]) -> dict:
    hits, outputs, shots, models = {}, {}, None, None
    for t in tasks:
        r = json.loads((folder / t / "results.json").read_text())
        hits.update(r["hits"])
        outputs.update(r["outputs"])
        shots, models = r.get("shots"), r.get("models")
    return {"hits": hits, "outputs": outputs, "shots": shots, "models": models}


def causes(merged: dict, task_files: Path, tasks: list[str]) -> dict:
    """Per task and method, the examples the better member gets right and the method does not:
    how many of them are the other (worse) member's own answer, and how many copy the question."""
    from ensemble_llm.bench import norm

    out = {}
    for t in tasks:
        hits, outs = merged["hits"][t], merged["outputs"][t]
        singles = singles_of(merged["hits"], [t])
        better = max(singles, key=lambda k: sum(hits[k]))
        worse = [k for k in singles if k != better][0]
        rows = [json.loads(x) for x in (task_files / f"{t}.jsonl").read_text().splitlines()[3:]]
        fig = {}
        for k in hits:
            if k.startswith("single-"):
                continue
            lost = [i for i in range(len(hits[k])) if hits[better][i] and not hits[k][i]]
            fig[k] = {
                "lost": len(lost),
                "worse_members_answer": sum(norm(outs[k][i]) == norm(outs[worse][i]) for i in lost),
                "copies_the_question": sum(norm(outs[k][i]) == norm(rows[i]["input"]) for i in lost),
            }
        out[t] = {"better": better, "methods": fig}
    return out


def keeps(hits: dict, tasks: list[str]) -> dict:
    """Per method: right answers over the better member's, pooled and per task."""
    better = {t: max(sum(hits[t][s]) for s in singles_of(hits, [t])) for t in tasks}
    labels = [k for k in hits[tasks[0]] if not k.startswith("single-")]
    out = {}
    for k in labels:
        mine = {t: sum(hits[t][k]) for t in tasks}
        out[k] = {
            "pooled": round(sum(mine.values()) / max(1, sum(better.values())), 3),
            "per_task": {t: round(mine[t] / better[t], 3) if better[t] else None for t in tasks},
        }
    return {"better_member_correct": better, "methods": out}


def keep_markdown(k: dict) -> str:
    tasks = list(k["better_member_correct"])
    lines = [
        "## What each method keeps of the better member's right answers",
        "",
        "| method | pooled | " + " | ".join(tasks) + " |",
        "|---|---|" + "---|" * len(tasks),
    ]
    for label, r in k["methods"].items():
        cells = [f"{v:.0%}" if v is not None else "" for v in r["per_task"].values()]
        lines.append(f"| {label} | {r['pooled']:.0%} | " + " | ".join(cells) + " |")
    better = " | ".join(str(v) for v in k["better_member_correct"].values())
    lines.append(f"| (better member, right answers) | {sum(k['better_member_correct'].values())} | {better} |")
    return "\n".join(lines) + "\n"


def cause_markdown(c: dict) -> str:
    lines = [
        "## Where a method loses the better member's right answers",
        "",
        "Of the examples the better member gets right and the method does not: how many are the other "
        "member's own answer, and how many copy the question.",
        "",
        "| task | better member | method | lost | the other member's answer | copies the question |",
        "|---|---|---|---|---|---|",
    ]
    for t, r in c.items():
        for k, f in r["methods"].items():
            lines.append(
                f"| {t} | {r['better']} | {k} | {f['lost']} | {f['worse_members_answer']} "
                f"| {f['copies_the_question']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", type=Path)
    ap.add_argument("--tasks", nargs="+", required=True)
    ap.add_argument("--title", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--task-files", type=Path, help="the task files (floor_tasks.py build): the causes table")
    args = ap.parse_args()
    merged = merge(args.runs, args.tasks)
    rep = report(merged, 0.1)
    rep["keeps"] = keeps(merged["hits"], sorted(args.tasks))
    if args.task_files:
        rep["causes"] = causes(merged, args.task_files, sorted(args.tasks))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(rep, indent=1) + "\n")
    text = markdown(rep, args.title) + "\n" + keep_markdown(rep["keeps"])
    if "causes" in rep:
        text += "\n" + cause_markdown(rep["causes"])
    (args.out / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
