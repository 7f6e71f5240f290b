"""What the per-request weights cost: a prompt's prefill with its shown answers scored
(`Member.score_prompt`, the logits of the answer rows too) against the plain prefill (the last
row only), per member, on one few-shot prompt of every suite task. Both run side by side,
alternating, `--repeats` times; the table gives medians and the extra time per request next to a
whole request's time (unite, the same prompt, greedy to the first newline).

    python benchmarks/evidence_cost.py --out benchmarks/results/evidence_cost
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ensemble_llm import Ensemble
from ensemble_llm.bench import SUITE, bundled_task, load_task
from ensemble_llm.evidence import answer_positions, answer_spans


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="evidence-cost")
    args = ap.parse_args()
    eng = Ensemble(method="unite", progress=False).load()
    rows = []
    for task in SUITE:
        shots, exs = load_task(bundled_task(task), 1)
        prompt = shots + f"Q: {exs[0]['input'].strip()}\nA:"
        plain, scored, positions = [0.0] * len(eng.members), [0.0] * len(eng.members), []
        for i, m in enumerate(eng.members):
            ids = m.prompt_ids(prompt)
            pos = answer_positions(m, prompt, ids, answer_spans(prompt))
            positions.append(len(pos))
            a, b = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                m.prefill(ids)
                a.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                m.score_prompt(ids, pos)
                m.prefill(ids)  # the hand-over: no second forward
                b.append(time.perf_counter() - t0)
            plain[i], scored[i] = statistics.median(a), statistics.median(b)
        req = statistics.median(
            eng.generate(prompt, raw=True, stop=["\n"], max_new_tokens=24).stats["time_s"] for _ in range(args.repeats)
        )
        extra = sum(scored) - sum(plain)
        rows.append(
            {
                "task": task,
                "prompt_tokens": [len(m.prompt_ids(prompt)) for m in eng.members],
                "scored_positions": positions,
                "prefill_s": plain,
                "scored_prefill_s": scored,
                "extra_s": extra,
                "request_s": req,
                "extra_fraction_of_request": extra / req,
            }
        )
        print(rows[-1])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [m.name for m in eng.members]
    (out / "results.json").write_text(json.dumps({"members": names, "repeats": args.repeats, "rows": rows}, indent=2))
    lines = [
        f"# Cost of the per-request weights ({', '.join(names)}, CPU, median of {args.repeats})",
        "",
        "| task | prompt tokens | scored rows | prefill s | prefill + scoring s | extra s | unite request s "
        "| extra / request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {'/'.join(map(str, r['prompt_tokens']))} | {'/'.join(map(str, r['scored_positions']))} | "
            f"{'/'.join(f'{x:.3f}' for x in r['prefill_s'])} | {'/'.join(f'{x:.3f}' for x in r['scored_prefill_s'])} | "
            f"{r['extra_s']:+.3f} | {r['request_s']:.2f} | {r['extra_fraction_of_request']:.1%} |"
        )
    mean = statistics.mean(r["extra_fraction_of_request"] for r in rows)
    lines += [
        "",
        f"Mean extra over a whole request: {mean:.1%}. Command: `python benchmarks/evidence_cost.py "
        f"--repeats {args.repeats} --out {args.out}`",
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
