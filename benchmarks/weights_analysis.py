"""Which per-request weights the evidence supports, read from weights_reliability.py's examples.

1. Reliability: over the examples where exactly one member is right, how often the member whose
   evidence is higher (it explains the shown answers better) is the right one, by bins of the
   evidence gap d = e_SmolLM2 - e_Gemma; and the same for whole tasks (their mean gap).
2. Weighting rules, compared offline on specfuse's choice between the members' answers: every
   member scores every member's answer (`scores`: its " answer\\n" tokens), each verifier's
   per-token geometric-mean probabilities are normalised over the answers, one Hedge step moves
   the weights as specfuse's first round does, and the answer with the larger weighted score is
   kept (the answers here are one segment). A rule maps (prior, evidence) to weights.
   Rules: the prior alone; the per-request posterior of the last round (log w = log prior + e);
   uniform; the evidence shrunk (log w = log prior + beta * d); the logistic fit of the
   reliability curve; routing only when one member's evidence is near the floor.

    python benchmarks/weights_analysis.py --examples benchmarks/results/weights_reliability/examples.jsonl \\
        --prior 0.567 --out benchmarks/results/weights_reliability
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

ETA = 1.0 * math.sqrt(1 / 2)  # specfuse's first-round Hedge rate for 2 members (hedge_lr 1, t = 1)


def load(path: Path, shots: str | None = None) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in rows if (shots is None or r["shots"] == shots) and None not in r["evidence"]]


def choose(row: dict, w: np.ndarray) -> int:
    """The member whose answer specfuse keeps under weights `w` (see the module)."""
    a = row["answers"]
    if a[0] == a[1]:
        return 0
    s = np.array([[lp / max(n, 1) for lp, n in per] for per in row["scores"]])  # [verifier, candidate]
    g = np.exp(s - s.max(axis=1, keepdims=True))
    g = g / g.sum(axis=1, keepdims=True)
    r = np.array([float(g[1, 0] >= g[1, 1]), float(g[0, 1] >= g[0, 0])])  # how the other member ranks it
    w = w * np.exp(ETA * r)
    w = w / w.sum()
    return int(np.argmax(w @ g))


def rule_weights(name: str, row: dict, prior: float, p: dict) -> np.ndarray:
    e = np.array(row["evidence"], dtype=float)
    lp = np.log([prior, 1 - prior])
    if name == "prior":
        x = lp
    elif name == "uniform":
        x = np.zeros(2)
    elif name == "posterior":  # the last round's default
        x = lp + e
    elif name == "shrunk":
        x = lp + p["beta"] * e
    elif name == "logistic":
        x = np.array([p["a"] + p["b"] * (e[0] - e[1]), 0.0])
    elif name == "floor":  # route only when a member is near the floor on the shots, else the prior
        x = lp.copy()
        lo = e < p["floor"]
        if lo.sum() == 1:
            x = np.where(lo, -20.0, 0.0)
    else:
        raise ValueError(name)
    w = np.exp(x - x.max())
    return w / w.sum()


def score(rows: list[dict], name: str, prior: float, p: dict) -> np.ndarray:
    """Per example: 1 when the kept answer is right."""
    return np.array([r["right"][choose(r, rule_weights(name, r, prior, p))] for r in rows])


def reliability(rows: list[dict], edges=(-9, -3, -1.5, -0.5, 0, 0.5, 1.5, 3, 9)) -> list[dict]:
    """P(SmolLM2 is the right one | exactly one is right) by bins of the evidence gap."""
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = [r for r in rows if lo <= r["evidence"][0] - r["evidence"][1] < hi and sum(r["right"]) == 1]
        if sel:
            out.append(
                {"gap": [lo, hi], "n": len(sel), "p_smol_right": round(np.mean([r["right"][0] for r in sel]), 3)}
            )
    return out


def fit_logistic(rows: list[dict]) -> dict:
    """P(SmolLM2 right | exactly one right) = sigmoid(a + b d), by Newton's method."""
    sel = [r for r in rows if sum(r["right"]) == 1]
    d = np.array([r["evidence"][0] - r["evidence"][1] for r in sel])
    y = np.array([r["right"][0] for r in sel], dtype=float)
    X = np.stack([np.ones_like(d), d], axis=1)
    beta = np.zeros(2)
    for _ in range(50):
        p = 1 / (1 + np.exp(-X @ beta))
        H = X.T @ (X * (p * (1 - p))[:, None]) + 1e-6 * np.eye(2)
        beta -= np.linalg.solve(H, X.T @ (p - y))
    return {"a": float(beta[0]), "b": float(beta[1]), "n": len(sel)}


def bootstrap(a: np.ndarray, b: np.ndarray, tasks: list[str], n: int = 2000, seed: int = 0) -> dict:
    """Pooled a - b in points with a paired bootstrap stratified by task."""
    rng = np.random.default_rng(seed)
    groups = defaultdict(list)
    for i, t in enumerate(tasks):
        groups[t].append(i)
    diff = a - b
    boot = np.zeros(n)
    for idx in groups.values():
        idx = np.array(idx)
        boot += diff[idx[rng.integers(0, len(idx), size=(n, len(idx)))]].sum(axis=1)
    boot = 100 * boot / len(a)
    return {
        "diff": round(100 * diff.mean(), 2),
        "low": round(float(np.percentile(boot, 2.5)), 2),
        "high": round(float(np.percentile(boot, 97.5)), 2),
    }


def compare(rows: list[dict], prior: float, rules: dict[str, dict]) -> dict:
    tasks = [r["task"] for r in rows]
    right = np.array([r["right"] for r in rows])
    singles = {"smol": right[:, 0], "gemma": right[:, 1]}
    best = max(singles, key=lambda k: singles[k].sum())
    router = np.zeros(len(rows))
    for t in set(tasks):
        idx = [i for i, x in enumerate(tasks) if x == t]
        k = max(singles, key=lambda k: singles[k][idx].sum())
        router[idx] = singles[k][idx]
    out = {
        "examples": len(rows),
        "smol": int(right[:, 0].sum()),
        "gemma": int(right[:, 1].sum()),
        "oracle": int(right.max(axis=1).sum()),
        "router": int(router.sum()),
        "rules": {},
    }
    for label, (name, p) in rules.items():
        hits = score(rows, name, prior, p)
        out["rules"][label] = {
            "correct": int(hits.sum()),
            "vs_best": bootstrap(hits, singles[best], tasks),
            "vs_router": bootstrap(hits, router, tasks),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=Path, required=True)
    ap.add_argument("--prior", type=float, required=True, help="the calibrated raw weight of SmolLM2")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    res = {}
    for shots in ("drawn", "fixed"):
        rows = load(args.examples, shots)
        if not rows:
            continue
        fit = fit_logistic(rows)
        rules = {
            "prior": ("prior", {}),
            "uniform": ("uniform", {}),
            "posterior": ("posterior", {}),
            "logistic": ("logistic", fit),
        }
        rules.update({f"shrunk:{b}": ("shrunk", {"beta": b}) for b in (0.1, 0.25, 0.5)})
        rules.update({f"floor:{f}": ("floor", {"floor": f}) for f in (-6.0, -4.0, -3.0)})
        res[shots] = {"reliability": reliability(rows), "logistic": fit, **compare(rows, args.prior, rules)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "analysis.json").write_text(json.dumps(res, indent=1))
    (args.out / "analysis.md").write_text(table(res, args))
    print(table(res, args))


def table(res: dict, args) -> str:
    """analysis.json as Markdown: each rule's correct answers, against the best member and the router."""
    lines = [f"# Weighting rules offline (`{args.examples}`, prior {args.prior})", ""]
    for shots, r in res.items():
        lines += [
            f"## {shots} shots: {r['examples']} examples; SmolLM2 {r['smol']}, Gemma {r['gemma']},"
            f" router {r['router']}, either right {r['oracle']}",
            "",
            "| rule | correct | vs best member, points (95%) | vs router, points (95%) |",
            "|---|---|---|---|",
        ]
        for name, x in r["rules"].items():
            b, t = x["vs_best"], x["vs_router"]
            lines.append(
                f"| {name} | {x['correct']} | {b['diff']:+.2f} ({b['low']:+.2f}..{b['high']:+.2f})"
                f" | {t['diff']:+.2f} ({t['low']:+.2f}..{t['high']:+.2f}) |"
            )
        bins = ", ".join(f"{b['gap']}: {b['p_smol_right']} (n {b['n']})" for b in r["reliability"])
        lines += ["", f"Reliability, P(SmolLM2 right | one member right) by evidence gap: {bins}", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
