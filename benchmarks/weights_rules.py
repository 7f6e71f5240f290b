"""Weighting rules judged leave-one-task-out on the weights grid (`weights_grid.py`).

Each rule turns the members' evidence on a task's prompt (the shown answers' log-probs; the
bench shows the same three shots for every example of a task) into one weight per task; its
accuracy on a task is read off the grid run at the nearest weight (the members alone at the
ends). Leave-one-task-out: for each task, the rule that scores best on the other six is chosen
and scored on the left-out task; the sum of those left-out scores is what rule *selection* earns.

    python benchmarks/weights_rules.py benchmarks/results/weights_grid
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ensemble_llm import Ensemble
from ensemble_llm.bench import bundled_task, load_task
from ensemble_llm.evidence import answer_positions, answer_spans, posterior


def evidence(eng: Ensemble, task: str) -> tuple[list[float], int, int]:
    shots, exs = load_task(bundled_task(task), 1)
    prompt = shots + f"Q: {exs[0]['input'].strip()}\nA:"
    spans = answer_spans(prompt)
    out = []
    for m in eng.members:
        ids = m.prompt_ids(prompt)
        out.append(sum(s.logprob for s in m.score_prompt(ids, answer_positions(m, prompt, ids, spans))))
    return out, len(spans), sum(b - a for a, b in spans)


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/weights_grid")
    res = json.loads((folder / "results.json").read_text())
    hits = res["hits"]
    grid = {1.0: "single-0", 0.0: "single-1"}
    grid.update({float(k.removeprefix("unite-w")): k for k in next(iter(hits.values())) if k.startswith("unite-w")})
    eng = Ensemble(method="unite", progress=False).load()
    prior = eng.member_weights("raw")[0]
    ev = {t: evidence(eng, t) for t in hits}
    rules = {
        "calibrated (static)": lambda e, n, b: prior,
        "uniform (static)": lambda e, n, b: [0.5, 0.5],
        "posterior, every answer (BMA)": lambda e, n, b: posterior(prior, e),
        "posterior, per answer (default)": lambda e, n, b: posterior(prior, [x / n for x in e]),
        "posterior, per byte": lambda e, n, b: posterior(prior, [x / b for x in e]),
        "posterior per answer, uniform prior": lambda e, n, b: posterior([0.5, 0.5], [x / n for x in e]),
    }

    def score(rule: str, task: str) -> tuple[int, float]:
        w = rules[rule](*ev[task])[0]
        near = min(grid, key=lambda g: (abs(g - w), g))
        return sum(hits[task][grid[near]]), w

    table = {r: {t: score(r, t) for t in hits} for r in rules}
    loto = 0
    for t in hits:
        best = max(rules, key=lambda r: sum(table[r][u][0] for u in hits if u != t))
        loto += table[best][t][0]
    n = sum(len(next(iter(h.values()))) for h in hits.values())
    lines = [
        f"# Weighting rules on the weights grid ({n} examples, nearest grid weight)",
        "",
        "| rule | " + " | ".join(hits) + " | pooled |",
        "|" + "---|" * (len(hits) + 2),
    ]
    for r, row in table.items():
        lines.append(
            f"| {r} | "
            + " | ".join(f"{row[t][0]} (w {row[t][1]:.2f})" for t in hits)
            + f" | {sum(v[0] for v in row.values())} |"
        )
    singles = {k: sum(sum(hits[t][k]) for t in hits) for k in ("single-0", "single-1")}
    router = sum(max(sum(hits[t]["single-0"]), sum(hits[t]["single-1"])) for t in hits)
    lines += [
        "",
        f"Members alone: {singles}; per-task router (oracle): {router}. Rule chosen on six tasks and "
        f"scored on the seventh, summed: {loto}. Evidence (log-prob of the shown answers, "
        f"answers, bytes): " + "; ".join(f"{t} {[round(x, 1) for x in e[0]]}, {e[1]}, {e[2]}" for t, e in ev.items()),
        "",
        f"Command: `python benchmarks/weights_rules.py {folder}`",
    ]
    (folder / "rules.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
