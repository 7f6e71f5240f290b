"""What each shot-exam threshold would have done, from runs already made (issue 60's tuning).

The exam (evidence.py) of a member: the mean over the examined shown answers (the second on) of
the sum of their tokens' gaps to the member's best token; a member `behind` nats or more below
another's steps aside. A request with a member aside runs the other alone, so its answer is that
member's own greedy answer (the bench's single run of the same prompt); any other request keeps
the ensemble's answer (the run with the exam off). Greedy decoding repeats (issue 59), so this is
what the engine does with the rule on, without running it again.

    python benchmarks/exam_rules.py --exam E.jsonl [E2.jsonl ...] --runs DIR [DIR ...] --out R.json

E: benchmarks/shot_exam.py's findings; DIR: folders of `ensemble-llm bench` runs (one task each,
with the single members and the methods run with exam=false). Fixed shots: one exam per task
(every example shows the same answers), so one line of E per task stands for all its examples.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BEHIND = (2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 1e9)  # 1e9: the exam off


def exam_of(member: list[dict]) -> float:
    examined = member[1:]
    return sum(a["gap"] for a in examined) / max(1, len(examined))


def aside(exam: list[list[dict]], behind: float) -> list[int]:
    """The members this threshold steps aside for one request."""
    gaps = [exam_of(m) for m in exam]
    return [k for k, g in enumerate(gaps) if max(gaps) - g >= behind]


def load_runs(folders: list[Path]) -> dict[str, dict]:
    """task -> {"hits": {label: [0/1]}, "models": [...]} from bench result folders."""
    out = {}
    for folder in folders:
        for res in sorted(folder.glob("*/results.json")):
            r = json.loads(res.read_text())
            for task, hits in r["hits"].items():
                out[task] = {"hits": hits, "models": r["models"]}
    return out


def apply(behind: float, exams: dict, runs: dict) -> dict:
    """Per task and method: right answers with the rule on, and how many requests it fired on."""
    out = {}
    for task, run in runs.items():
        rows = exams.get(task)
        if rows is None:
            continue
        hits = run["hits"]
        singles = [hits[f"single-{k}"] for k in range(len(run["models"]))]
        methods = [label for label in hits if not label.startswith("single")]
        n = len(singles[0]) if len(rows) == 1 else min(len(singles[0]), len(rows))
        fig = {"examples": n, "single": [sum(s[:n]) for s in singles], "fired": 0}
        for label in methods:
            fig[label] = 0
        for i in range(n):
            gone = aside(rows[i if len(rows) > 1 else 0]["exam"], behind)
            stay = [k for k in range(len(singles)) if k not in gone]
            fig["fired"] += bool(gone)
            for label in methods:
                fig[label] += singles[stay[0]][i] if len(stay) == 1 else hits[label][i]
        out[task] = fig
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exam", nargs="+", type=Path, required=True)
    ap.add_argument("--runs", nargs="+", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    exams: dict[str, list] = {}
    for path in args.exam:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            exams.setdefault(row["task"], []).append(row)
    runs = load_runs(args.runs)
    result = {f"behind={b:g}": apply(b, exams, runs) for b in BEHIND}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(table(result))
    print(table(result))


def table(result: dict) -> str:
    """Pooled right answers per threshold and method, requests fired on, and per task."""
    first = next(iter(result.values()))
    methods = [k for k in next(iter(first.values())) if k not in ("examples", "single", "fired")]
    best = max(sum(f["single"][i] for f in first.values()) for i in range(2))
    router = sum(max(f["single"]) for f in first.values())
    named = ", ".join(f"{t} ({f['examples']})" for t, f in first.items())
    lines = [
        "# Shot-exam thresholds on the tune data",
        "",
        f"Tasks: {named}. Best member pooled {best}, "
        f"per-task router {router}. `behind`: nats per examined answer (1e+09: the exam off).",
        "",
        "| behind | requests fired | " + " | ".join(methods) + " | " + " | ".join(f"{t} fired" for t in first) + " |",
        "|---|---|" + "---|" * (len(methods) + len(first)),
    ]
    for rule, tasks in result.items():
        pooled = [str(sum(f[k] for f in tasks.values())) for k in methods]
        fired = sum(f["fired"] for f in tasks.values())
        per = [str(f["fired"]) for f in tasks.values()]
        lines.append(f"| {rule.split('=')[1]} | {fired} | " + " | ".join(pooled) + " | " + " | ".join(per) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
