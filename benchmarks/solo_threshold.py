"""Would running the favoured member alone pay on the pair? An offline check of a rule the
engine does NOT use: a request whose per-request weights give one member at least t runs that
member alone (the posterior only, without the prior that `solo` also asks for).

The committed dev-suite runs are greedy and deterministic, so a request run alone gets exactly
that member's `single` hit, and every other request the method's own: the rule's score for any t
follows from the per-example hits of `suite800/` (unite, safe, specfuse) and `suite_smc/` (smc),
and the per-request weights, collected here by running the same prompts for one token each
(`--weights`, reused when the file exists). t is chosen leave-one-task-out (the best t on six
tasks, ties to the larger t, scored on the seventh); the committed figures are the left-out ones.

    python benchmarks/solo_threshold.py --out benchmarks/results/solo_threshold
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ensemble_llm import Ensemble
from ensemble_llm.bench import SUITE, bootstrap_diff, load_task, resolve_task

GRID = [0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.97, 0.99, 1.01]  # 1.01: never alone (the method as it is)
RUNS = {"unite": "suite800", "safe": "suite800", "specfuse": "suite800", "smc:n_particles=4": "suite_smc"}


def collect_weights(n: int) -> dict[str, list[list[float]]]:
    """Each suite prompt's per-request weights (unite's, solo off), as the bench built the prompts."""
    eng = Ensemble(["smollm2-135m-instruct", "gemma-3-270m"], "unite", config={"solo": None}, progress=False)
    out = {}
    for task in SUITE:
        shots, exs = load_task(*resolve_task(f"{task}:{n}", n))
        out[task] = []
        for ex in exs:
            r = eng.generate(shots + f"Q: {ex['input'].strip()}\nA:", max_new_tokens=1, raw=True, stop=["\n"])
            out[task].append(list(r.stats["member_weights"].values()))
    return out


def rule_hits(hits: dict, method: str, weights: list[list[float]], t: float) -> list[int]:
    """One task's hits under the rule: the favoured member's own where its weight is >= t."""
    out = []
    for i, own in enumerate(hits[method]):
        w = weights[i]
        k = max(range(len(w)), key=lambda j: w[j])
        out.append(hits[f"single-{k}"][i] if w[k] >= t else own)
    return out


def study(method: str, run: str, weights: dict) -> dict:
    hits = json.loads(Path(f"benchmarks/results/{run}/results.json").read_text())["hits"]
    tasks = list(hits)
    by_t = {t: {task: rule_hits(hits[task], method, weights[task], t) for task in tasks} for t in GRID}
    left, chosen = {}, {}
    for held in tasks:
        best = max(GRID, key=lambda t: (sum(sum(by_t[t][x]) for x in tasks if x != held), t))
        chosen[held], left[held] = best, by_t[best][held]
    best_member = max(("single-0", "single-1"), key=lambda k: sum(sum(hits[x][k]) for x in tasks))
    return {
        "examples": sum(len(v) for v in left.values()),
        "method_correct": sum(sum(hits[x][method]) for x in tasks),
        "best_member": best_member,
        "best_member_correct": sum(sum(hits[x][best_member]) for x in tasks),
        "correct_by_threshold": {str(t): sum(sum(v) for v in by_t[t].values()) for t in GRID},
        "left_out_threshold": chosen,
        "left_out_correct": sum(sum(v) for v in left.values()),
        "left_out_per_task": {x: sum(v) for x, v in left.items()},
        "left_out_vs_method": bootstrap_diff(left, {x: hits[x][method] for x in tasks}),
        "left_out_vs_best_member": bootstrap_diff(left, {x: hits[x][best_member] for x in tasks}),
    }


def markdown(res: dict) -> str:
    lines = [
        "# Running the favoured member alone when its per-request weight is >= t (offline, the pair)",
        "",
        "From the committed per-example hits (`suite800/`, `suite_smc/`) and each request's weights;",
        "t chosen leave-one-task-out. `python benchmarks/solo_threshold.py`.",
        "",
        "| method | method as is | best t in sample (correct) | left-out correct | left-out vs method | "
        "left-out vs best member |",
        "|---|---|---|---|---|---|",
    ]
    for m, r in res["methods"].items():
        best = max(r["correct_by_threshold"].items(), key=lambda kv: (kv[1], float(kv[0])))
        d, b = r["left_out_vs_method"], r["left_out_vs_best_member"]
        lines.append(
            f"| {m} | {r['method_correct']}/{r['examples']} | {best[0]} ({best[1]}) | {r['left_out_correct']} | "
            f"{d['diff']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}] | "
            f"{b['diff']:+.2f} [{b['low']:+.2f}, {b['high']:+.2f}] |"
        )
    lines += ["", "Weights per task (the shots, hence the evidence, are the same for every example of a task):", ""]
    for task, ws in res["weights"].items():
        lines.append(f"- {task}: " + "/".join(f"{w:.3f}" for w in ws[0]))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=115, help="per task, as in suite800")
    ap.add_argument("--weights", default="benchmarks/results/solo_threshold/weights.json")
    ap.add_argument("--out", default="benchmarks/results/solo_threshold")
    args = ap.parse_args()
    path = Path(args.weights)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(collect_weights(args.examples)))
    weights = json.loads(path.read_text())
    res = {"grid": GRID, "methods": {m: study(m, run, weights) for m, run in RUNS.items()}, "weights": weights}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({k: v for k, v in res.items() if k != "weights"}, indent=1))
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
