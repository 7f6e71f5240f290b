"""The bench's statistics (floor 5): pooled accuracy and paired-bootstrap intervals of each
ensemble against the members alone."""

from __future__ import annotations

from typing import Any, Sequence

BOOTSTRAP = 2000  # paired-bootstrap resamples for the 95% intervals


def bootstrap_diff(
    a: dict[str, Sequence[int]], b: dict[str, Sequence[int]], *, resamples: int = BOOTSTRAP, seed: int = 0
) -> dict[str, float]:
    """Paired bootstrap of the pooled accuracy difference a - b (in points, 0-100) over the tasks'
    examples: each resample draws every task's examples with replacement (stratified by task, so
    the task mix stays fixed), the same draws for a and b. Returns the difference and its 95%
    percentile interval."""
    import numpy as np

    rng = np.random.default_rng(seed)
    diffs = [np.asarray(a[t], dtype=float) - np.asarray(b[t], dtype=float) for t in a]
    n = sum(len(d) for d in diffs)
    if not n:
        return {"diff": 0.0, "low": 0.0, "high": 0.0, "examples": 0}
    total = np.zeros(resamples)
    for d in diffs:
        if len(d):
            total += d[rng.integers(0, len(d), size=(resamples, len(d)))].sum(axis=1)
    boot = 100.0 * total / n
    return {
        "diff": round(100.0 * float(sum(d.sum() for d in diffs)) / n, 2),
        "low": round(float(np.percentile(boot, 2.5)), 2),
        "high": round(float(np.percentile(boot, 97.5)), 2),
        "examples": n,
    }


def compare_to_members(quality: dict[str, dict]) -> dict[str, Any]:
    """Every ensemble method against the members alone, on the few-shot tasks: the pooled
    difference to the best single member (best pooled), to a per-task router (the better member
    on each task, chosen on the same data: an oracle a method has to match), and per task to
    that task's best member, each with a paired-bootstrap 95% interval (points)."""
    tasks = [t for t, q in quality.items() if not q["chat"]]
    if not tasks:
        return {}
    hits = {t: quality[t]["hits"] for t in tasks}
    labels = list(hits[tasks[0]])
    singles = [k for k in labels if k.startswith("single-")]
    if not singles:
        return {}
    score = {k: sum(sum(hits[t][k]) for t in tasks) for k in labels}
    best = max(singles, key=lambda k: (score[k], k))
    router = {t: hits[t][max(singles, key=lambda k: (sum(hits[t][k]), k))] for t in tasks}
    out: dict[str, Any] = {
        "tasks": tasks,
        "best_single": best,
        "router_correct": sum(sum(v) for v in router.values()),
        "methods": {},
    }
    for k in labels:
        if k in singles:
            continue
        mine = {t: hits[t][k] for t in tasks}
        row = {
            "vs_best_single": bootstrap_diff(mine, {t: hits[t][best] for t in tasks}),
            "vs_router": bootstrap_diff(mine, router),
            "per_task": {},
        }
        for t in tasks:
            task_best = max(singles, key=lambda s: (sum(hits[t][s]), s))
            row["per_task"][t] = {"best_single": task_best, **bootstrap_diff({t: mine[t]}, {t: hits[t][task_best]})}
        out["methods"][k] = row
    return out


def pooled(accuracy: dict[str, float], examples: dict[str, int]) -> float:
    """Accuracy over all scored examples of all tasks together."""
    n = sum(examples[t] for t in accuracy)
    return sum(accuracy[t] * examples[t] for t in accuracy) / n if n else 0.0
