"""unite and safe with the union counted onto the main member's tokens (`onto_main`, the default
since this script) against UniTE's first-sub-token rule, on the dev suite's 787 examples.

Reads the bench's per-example hits: `--new` (runs of both rules, e.g. `ensemble-llm bench
--methods unite safe unite:onto_main=false safe:onto_main=false --tasks suite:115 --speed-prompts
0`) and `--members` (a run with the singles on the same examples; greedy
single runs do not touch the code this changes). Reports per task and pooled, with paired-bootstrap
95% intervals: each rule against the best member, the per-task router and the other rule; and a
leave-one-task-out choice of the rule (the better rule on six tasks, scored on the seventh).

    python benchmarks/onto_main.py --new benchmarks/results/suite_onto_main \\
        --members benchmarks/results/suite800 --out benchmarks/results/suite_onto_main
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ensemble_llm.bench import SUITE, bootstrap_diff

PAIRS = {"unite": ("unite", "unite:onto_main=False"), "safe": ("safe", "safe:onto_main=False")}


def load_hits(folder: str) -> dict[str, dict[str, list[int]]]:
    return json.loads((Path(folder) / "results.json").read_text())["hits"]


def pooled(hits: dict[str, list[int]]) -> int:
    return sum(sum(v) for v in hits.values())


def singles(hits: dict[str, dict[str, list[int]]], tasks: list[str]) -> tuple[dict, dict, dict, dict]:
    """The pair's singles on `tasks` (SmolLM2, Gemma-3), the better of them pooled, and the
    per-task router (the better member on each task, ties: SmolLM2)."""
    smol = {t: hits[t]["single-0"] for t in tasks}
    gemma = {t: hits[t]["single-1"] for t in tasks}
    best = smol if pooled(smol) >= pooled(gemma) else gemma
    router = {t: smol[t] if sum(smol[t]) >= sum(gemma[t]) else gemma[t] for t in tasks}
    return smol, gemma, best, router


def write_comparison(folder: str, report: dict, lines: list[str]) -> None:
    """comparison.json and comparison.md into `folder`; the table printed too."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.json").write_text(json.dumps(report, indent=1))
    (out / "comparison.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def loto(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, list[int]]:
    """Per task, the hits of the rule that scores more on the other six tasks (ties: `a`)."""
    out = {}
    for t in a:
        rest_a = sum(sum(a[u]) for u in a if u != t)
        rest_b = sum(sum(b[u]) for u in b if u != t)
        out[t] = a[t] if rest_a >= rest_b else b[t]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", required=True, nargs="+", help="bench result folders (their hits are merged)")
    ap.add_argument("--members", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    new, old = {}, load_hits(args.members)
    for folder in args.new:
        for t, h in load_hits(folder).items():
            new.setdefault(t, {}).update(h)
    tasks = [t for t in SUITE if t in new]
    smol, gemma, best, router = singles(old, tasks)
    rows, report = [], {}
    lines = [
        "# unite and safe: the union onto the main member's tokens against UniTE's first-sub-token rule",
        "",
        f"Hits: `{' '.join(args.new)}` (the two rules) and `{args.members}` (the singles). Differences in points "
        "with paired-bootstrap 95% intervals; 'left out': the rule chosen on the other six tasks, per task.",
        "",
        "| method | rule | "
        + " | ".join(tasks)
        + " | pooled | vs best member | vs per-task router | vs the other rule |",
        "|---|---|" + "---|" * len(tasks) + "---|---|---|---|",
    ]
    for t_name, h in (("SmolLM2", smol), ("Gemma-3", gemma)):
        lines.append(f"| single {t_name} | | " + " | ".join(str(sum(h[t])) for t in tasks) + f" | {pooled(h)} | | | |")
    for method, (on, off) in PAIRS.items():
        if on not in new[tasks[0]] or off not in new[tasks[0]]:
            continue
        a = {t: new[t][on] for t in tasks}
        b = {t: new[t][off] for t in tasks}
        left_out = loto(a, b)
        for rule, h, other in (("onto_main", a, b), ("first sub-token", b, a), ("left out", left_out, b)):
            r = {
                "method": method,
                "rule": rule,
                "per_task": {t: sum(h[t]) for t in tasks},
                "pooled": pooled(h),
                "vs_best": bootstrap_diff(h, best),
                "vs_router": bootstrap_diff(h, router),
                "vs_other": bootstrap_diff(h, other) if rule != "first sub-token" else bootstrap_diff(h, a),
            }
            rows.append(r)

            def fmt(d):
                return f"{d['diff']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]"

            lines.append(
                f"| {method} | {rule} | "
                + " | ".join(str(r["per_task"][t]) for t in tasks)
                + f" | {r['pooled']} | {fmt(r['vs_best'])} | {fmt(r['vs_router'])} | {fmt(r['vs_other'])} |"
            )
    report = {"best_member": pooled(best), "router": pooled(router), "rows": rows}
    lines += ["", f"Best member pooled: {pooled(best)}; per-task router (oracle): {pooled(router)}."]
    write_comparison(args.out, report, lines)


if __name__ == "__main__":
    main()
