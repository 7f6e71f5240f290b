"""What each shot-exam threshold, with and without the copy test, would have done, from runs
already made (issue 60's tuning).

The exam (evidence.py) of a member: the mean over the examined shown answers (the second on) of
the sum of their tokens' gaps to the member's best token; a member `behind` nats or more below
another's steps aside; with the copy test, so does a member left whose greedy reply is the
query's question where another member's is not (`evidence.copy_aside`). A request with a member
aside runs the other alone, so its answer is that member's own greedy answer (the bench's single
run of the same prompt); any other request keeps the ensemble's answer (the run with the exam
off). Greedy decoding repeats (issue 59), so this is what the engine does with the rule on,
without running it again.

    python benchmarks/exam_rules.py --exam E.jsonl [E2.jsonl ...] --runs DIR [DIR ...] --out R.json --title T

E: benchmarks/shot_exam.py's findings; DIR: folders of `ensemble-llm bench` runs (one task each,
as DIR/TASK/results.json or as the committed DIR/TASK.json,
with the single members and the methods run with exam=false, or with the exam on at a threshold
asked for, whose own requests aside are then the rule's). Fixed shots: every example shows the
same answers, so a task's one line of E can stand for all its examples' exam (not their copy test).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ensemble_llm.evidence import copy_aside

BEHIND = (2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 1e9)  # 1e9: the exam off


def exam_of(member: list[dict]) -> float:
    examined = member[1:]
    return sum(a["gap"] for a in examined) / max(1, len(examined))


def aside(row: dict, behind: float, copy: bool) -> list[int]:
    """The members this rule steps aside for one request."""
    gaps = [exam_of(m) for m in row["exam"]]
    gone = [k for k, g in enumerate(gaps) if max(gaps) - g >= behind]
    if copy and row.get("copy"):
        gone = sorted(set(gone) | set(copy_aside(row["copy"], gone)))
    return gone


def load_runs(folders: list[Path]) -> dict[str, dict]:
    """task -> {"hits": {label: [0/1]}, "models": [...]} from bench result folders."""
    out = {}
    for folder in folders:
        for res in sorted(folder.glob("*/results.json")) + sorted(folder.glob("*.json")):
            r = json.loads(res.read_text())
            for task, hits in r["hits"].items():
                out[task] = {"hits": hits, "models": r["models"]}
    return out


def apply(behind: float, copy: bool, exams: dict, runs: dict) -> dict:
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
        fig = {"examples": n, "single": [sum(s[:n]) for s in singles], "fired": 0, "kept": {}}
        better = max(range(len(singles)), key=lambda k: sum(singles[k][:n]))
        for label in methods:
            fig[label] = fig["kept"][label] = 0
        for i in range(n):
            gone = aside(rows[i if len(rows) > 1 else 0], behind, copy)
            stay = [k for k in range(len(singles)) if k not in gone]
            fig["fired"] += bool(gone)
            for label in methods:
                right = singles[stay[0]][i] if len(stay) == 1 else hits[label][i]
                fig[label] += right
                fig["kept"][label] += right and singles[better][i]
        out[task] = fig
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exam", nargs="+", type=Path, required=True)
    ap.add_argument("--runs", nargs="+", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="Shot-exam thresholds and the copy test")
    ap.add_argument(
        "--behind", type=float, nargs="+", default=BEHIND, help="the thresholds (runs with the exam on: theirs)"
    )
    args = ap.parse_args()
    exams: dict[str, list] = {}
    for path in args.exam:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            exams.setdefault(row["task"], []).append(row)
    runs = load_runs(args.runs)
    result = {
        f"behind={b:g}{'+copy' if copy else ''}": apply(b, copy, exams, runs)
        for b in args.behind
        for copy in (False, True)
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(table(result, args.title))
    print(table(result, args.title))


def table(result: dict, title: str) -> str:
    """Pooled right answers per threshold and method, requests fired on, and per task."""
    first = next(iter(result.values()))
    every = [k for f in first.values() for k in f if k not in ("examples", "single", "fired", "kept")]
    every = list(dict.fromkeys(every))
    methods = [k for k in every if all(k in f for f in first.values())]  # pooled: the methods run on every task
    best = max(sum(f["single"][i] for f in first.values()) for i in range(2))
    router = sum(max(f["single"]) for f in first.values())
    named = ", ".join(f"{t} ({f['examples']})" for t, f in first.items())
    lines = [
        f"# {title}",
        "",
        f"Tasks: {named}. Best member pooled {best}, "
        f"per-task router {router}. `behind`: nats per examined answer (1e+09: the exam off); "
        "+copy: with the copy test.",
        "",
        "| rule | requests fired | " + " | ".join(methods) + " | " + " | ".join(f"{t} fired" for t in first) + " |",
        "|---|---|" + "---|" * (len(methods) + len(first)),
    ]
    for rule, tasks in result.items():
        pooled = [str(sum(f[k] for f in tasks.values())) for k in methods]
        fired = sum(f["fired"] for f in tasks.values())
        per = [str(f["fired"]) for f in tasks.values()]
        lines.append(f"| {rule.split('=')[1]} | {fired} | " + " | ".join(pooled) + " | " + " | ".join(per) + " |")
    lines += ["", "Right answers per task, and of the better member's right answers how many each keeps:", ""]
    lines += ["| rule | task | members | " + " | ".join(every) + " |", "|---|---|---|" + "---|" * len(every)]
    for rule, tasks in result.items():
        if not rule.startswith(("behind=3", "behind=1e+09")) and len(result) > 2:
            continue
        for t, f in tasks.items():
            best = max(f["single"])
            cells = [f"{f[k]} ({f['kept'][k]}/{best})" if k in f else "" for k in every]
            name = f"| {rule.split('=')[1]} | {t} | {'/'.join(map(str, f['single']))} | "
            lines.append(name + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
