"""What the per-request weights cost: a prompt's prefill with its shown answers scored
(`Member.score_prompt`, the logits of the answer rows too) against the plain prefill (the last
row only), per member, on one few-shot prompt of every suite task. Both run side by side,
alternating, `--repeats` times; the table gives medians and the extra time per request next to a
whole request's time (unite, the same prompt, greedy to the first newline). The scored prefill is
also timed with the linear layers as they are (`members/headpad.py`'s plans undone), alternating
with the planned ones, so the plans' share is measured in the same run.

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
from ensemble_llm.members.headpad import describe, pad_rows


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
        n = len(eng.members)
        plain, scored, unpadded, positions = [0.0] * n, [0.0] * n, [0.0] * n, []
        for i, m in enumerate(eng.members):
            ids = m.prompt_ids(prompt)
            pos = answer_positions(m, prompt, ids, answer_spans(prompt))
            positions.append(len(pos))
            a, b, c = [], [], []
            for _ in range(args.repeats):
                a.append(_timed(m.prefill, ids))
                b.append(_timed(_scored, m, ids, pos))
                pad_rows(m.model, None)
                c.append(_timed(_scored, m, ids, pos))
                pad_rows(m.model, m.row_plans)
            plain[i], scored[i], unpadded[i] = (statistics.median(x) for x in (a, b, c))
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
                "scored_prefill_unpadded_s": unpadded,
                "extra_unpadded_s": sum(unpadded) - sum(plain),
                "extra_s": extra,
                "request_s": req,
                "extra_fraction_of_request": extra / req,
            }
        )
        print(rows[-1])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [m.name for m in eng.members]
    pads = {m.name: describe(m.row_plans.get(tuple(m.model.get_output_embeddings().weight.shape))) for m in eng.members}
    (out / "results.json").write_text(
        json.dumps({"members": names, "head_plan": pads, "repeats": args.repeats, "rows": rows}, indent=2)
    )
    lines = [
        f"# Cost of the per-request weights ({', '.join(names)}, CPU, median of {args.repeats})",
        "",
        "| task | prompt tokens | scored rows | prefill s | prefill + scoring s | extra s | unite request s "
        "| extra / request | extra, output layer unpadded |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {'/'.join(map(str, r['prompt_tokens']))} | {'/'.join(map(str, r['scored_positions']))} | "
            f"{'/'.join(f'{x:.3f}' for x in r['prefill_s'])} | {'/'.join(f'{x:.3f}' for x in r['scored_prefill_s'])} | "
            f"{r['extra_s']:+.3f} | {r['request_s']:.2f} | {r['extra_fraction_of_request']:.1%} | "
            f"{r['extra_unpadded_s']:+.3f} ({r['extra_unpadded_s'] / r['request_s']:.1%}) |"
        )
    mean = statistics.mean(r["extra_fraction_of_request"] for r in rows)
    mean_unpadded = statistics.mean(r["extra_unpadded_s"] / r["request_s"] for r in rows)
    pooled = sum(r["extra_s"] for r in rows) / sum(r["request_s"] for r in rows)
    lines += [
        "",
        f"Output layers' plans (members/headpad.py, timed at load; unpadded: every layer's plan undone): {pads}.",
        "",
        f"Mean extra over a whole request: {mean:.1%} (unpadded output layers: {mean_unpadded:.1%}); "
        f"the extra time of all seven over their requests' time: {pooled:.1%}.",
        "",
        f"Command: `python benchmarks/evidence_cost.py --repeats {args.repeats} --out {args.out}`",
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _scored(m, ids, pos) -> None:
    m.score_prompt(ids, pos)
    m.prefill(ids)  # the hand-over: no second forward


if __name__ == "__main__":
    main()
