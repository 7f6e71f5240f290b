"""smc's member weights on the dev suite: which weights the product (smc's default f) should use,
chosen leave-one-task-out.

Reads the bench's per-example hits of several runs of smc on the same examples, one option per
run (`--option LABEL=FOLDER:METHOD`, METHOD the bench's row name in that run), and the singles
(`--members`, a run with `single-0` and `single-1` on those examples). Reports per task and
pooled, with paired-bootstrap 95% intervals against the best member, the per-task router and the
first option; and the leave-one-task-out choice: for each task, the option that scores most on
the other six (ties: the earlier option), scored on that task.

    python benchmarks/smc_weights.py --members benchmarks/results/suite_smc \\
        --option "posterior exponents=benchmarks/results/suite_smc:smc:n_particles=4" \\
        --option "uniform prior + evidence=benchmarks/results/suite_smc_uprior:smc:n_particles=4" \\
        --option "equal exponents=benchmarks/results/suite_smc_uniform:smc:n_particles=4,weights=None" \\
        --out benchmarks/results/suite_smc_uniform
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ensemble_llm.bench import SUITE, bootstrap_diff

sys.path.insert(0, str(Path(__file__).resolve().parent))
from onto_main import load_hits, pooled, singles, write_comparison  # noqa: E402 (the same hits and tables)


def loto(options: list[dict[str, list[int]]]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Per task, the hits of the option that scores most on the other tasks (ties: the earlier
    option), and which option that was (its index)."""
    out, picks = {}, {}
    for t in options[0]:
        rest = [sum(sum(h[u]) for u in h if u != t) for h in options]
        picks[t] = max(range(len(options)), key=lambda i: (rest[i], -i))
        out[t] = options[picks[t]][t]
    return out, picks


def fmt(d: dict[str, float]) -> str:
    return f"{d['diff']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--option", action="append", required=True, help="LABEL=FOLDER:METHOD")
    ap.add_argument("--members", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    members = load_hits(args.members)
    labels, options = [], []
    for spec in args.option:
        label, rest = spec.split("=", 1)
        folder, method = rest.split(":", 1)
        hits = load_hits(folder)
        labels.append(label)
        options.append({t: hits[t][method] for t in SUITE if t in hits})
    tasks = list(options[0])
    smol, gemma, best, router = singles(members, tasks)
    left_out, picks = loto(options)
    lines = [
        "# smc's member weights on the dev suite, chosen leave-one-task-out",
        "",
        "Options: " + "; ".join(f"`{s}`" for s in args.option) + f"; singles: `{args.members}`. Differences in points "
        "with paired-bootstrap 95% intervals; 'left out': per task, the option that scores most on the other six.",
        "",
        "| option | " + " | ".join(tasks) + f" | pooled | vs best member | vs per-task router | vs {labels[0]} |",
        "|---|" + "---|" * len(tasks) + "---|---|---|---|",
    ]
    for name, h in (("single SmolLM2", smol), ("single Gemma-3", gemma)):
        lines.append(f"| {name} | " + " | ".join(str(sum(h[t])) for t in tasks) + f" | {pooled(h)} | | | |")
    rows = []
    for label, h in [*zip(labels, options), ("left out", left_out)]:
        r = {
            "option": label,
            "per_task": {t: sum(h[t]) for t in tasks},
            "pooled": pooled(h),
            "vs_best": bootstrap_diff(h, best),
            "vs_router": bootstrap_diff(h, router),
            "vs_first": bootstrap_diff(h, options[0]),
        }
        rows.append(r)
        lines.append(
            f"| {label} | "
            + " | ".join(str(r["per_task"][t]) for t in tasks)
            + f" | {r['pooled']} | {fmt(r['vs_best'])} | {fmt(r['vs_router'])} | {fmt(r['vs_first'])} |"
        )
    chosen = {t: labels[i] for t, i in picks.items()}
    lines += [
        "",
        f"Best member pooled: {pooled(best)}; per-task router (oracle): {pooled(router)}.",
        "Left-out choice per task: " + ", ".join(f"{t}: {c}" for t, c in chosen.items()) + ".",
    ]
    report = {"best_member": pooled(best), "router": pooled(router), "rows": rows, "left_out_choice": chosen}
    write_comparison(args.out, report, lines)


if __name__ == "__main__":
    main()
