"""What the per-request weights cost: a prompt's prefill with its shown answers scored
(`Member.score_prompt`, the logits of the answer rows too) against the plain prefill (the last
row only), per member, on one few-shot prompt of every suite task. Both run side by side,
alternating, `--repeats` times; the table gives medians and the extra time per request next to a
whole request's time (unite, the same prompt, greedy to the first newline). Each is measured
cold (prefix reuse off: the whole prompt runs) and warm (the task's previous request, another
example with the same shots, stored with its scores, as a run over a task leaves it: the shots'
scores are read, members/prefix.py). The cold scored prefill is also timed with the linear layers
as they are (`members/headpad.py`'s plans undone), alternating with the planned ones, so the
plans' share is measured in the same run.

    python benchmarks/evidence_cost.py --out benchmarks/results/evidence_cost
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

from ensemble_llm import Ensemble
from ensemble_llm.bench import SUITE, bundled_task, load_task
from ensemble_llm.evidence import answer_positions, answer_spans
from ensemble_llm.members.headpad import describe, pad_rows
from ensemble_llm.members.prefix import PrefixCache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="evidence-cost")
    args = ap.parse_args()
    eng = Ensemble(method="unite", progress=False).load()
    rows = [_task_row(eng, task, args.repeats) for task in SUITE]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [m.name for m in eng.members]
    pads = {m.name: describe(m.row_plans.get(tuple(m.model.get_output_embeddings().weight.shape))) for m in eng.members}
    (out / "results.json").write_text(
        json.dumps({"members": names, "head_plan": pads, "repeats": args.repeats, "rows": rows}, indent=2)
    )
    table = _table(names, pads, rows, args)
    (out / "results.md").write_text(table + "\n")
    print(table)


def _task_row(eng, task: str, repeats: int) -> dict:
    """One task's prompt (its first example; the previous request: its second example's prompt),
    cold (prefix reuse off) and warm (the previous prompt stored, with its scores)."""
    shots, exs = load_task(bundled_task(task), 2)
    prompt, before = (shots + f"Q: {e['input'].strip()}\nA:" for e in exs)
    n = len(eng.members)
    plain, scored, unplanned, warm_plain, warm_scored = ([0.0] * n for _ in range(5))
    positions = []
    for i, m in enumerate(eng.members):
        ids, ids0 = m.prompt_ids(prompt), m.prompt_ids(before)
        pos = answer_positions(m, prompt, ids, answer_spans(prompt))
        pos0 = answer_positions(m, before, ids0, answer_spans(before))
        positions.append(len(pos))
        a, b, c, d, e = [], [], [], [], []
        for _ in range(repeats):
            with _prefixes(m, 0):
                a.append(_timed(m.prefill, ids))
                b.append(_timed(_scored, m, ids, pos))
                pad_rows(m.model, None)
                c.append(_timed(_scored, m, ids, pos))
                pad_rows(m.model, m.row_plans)
            with _prefixes(m, 2**30):
                _scored(m, ids0, pos0)
                d.append(_timed(m.prefill, ids))
            with _prefixes(m, 2**30):
                _scored(m, ids0, pos0)
                e.append(_timed(_scored, m, ids, pos))
        for out, xs in zip((plain, scored, unplanned, warm_plain, warm_scored), (a, b, c, d, e)):
            out[i] = statistics.median(xs)
    ask = dict(raw=True, stop=["\n"], max_new_tokens=24)
    cold, warm = [], []
    for _ in range(repeats):
        with contextlib.ExitStack() as stack:
            for m in eng.members:
                stack.enter_context(_prefixes(m, 0))
            cold.append(eng.generate(prompt, **ask).stats["time_s"])
        with contextlib.ExitStack() as stack:
            for m in eng.members:
                stack.enter_context(_prefixes(m, 2**30))
            eng.generate(before, **ask)
            warm.append(eng.generate(prompt, **ask).stats["time_s"])
    row = {
        "task": task,
        "prompt_tokens": [len(m.prompt_ids(prompt)) for m in eng.members],
        "scored_positions": positions,
        "prefill_s": plain,
        "scored_prefill_s": scored,
        "scored_prefill_unpadded_s": unplanned,
        "extra_unpadded_s": sum(unplanned) - sum(plain),
        "extra_s": sum(scored) - sum(plain),
        "request_s": statistics.median(cold),
        "warm_prefill_s": warm_plain,
        "warm_scored_prefill_s": warm_scored,
        "warm_extra_s": sum(warm_scored) - sum(warm_plain),
        "warm_request_s": statistics.median(warm),
    }
    row["extra_fraction_of_request"] = row["extra_s"] / row["request_s"]
    row["warm_extra_fraction_of_request"] = row["warm_extra_s"] / row["warm_request_s"]
    print(row, flush=True)
    return row


def _table(names, pads, rows, args) -> str:
    def pair(xs):
        return "/".join(f"{x:.3f}" for x in xs)

    lines = [
        f"# Cost of the per-request weights ({', '.join(names)}, CPU, median of {args.repeats})",
        "",
        "Cold: no stored prompt (prefix reuse off). Warm: the task's previous request (its next example, the same "
        "shots) stored with its scores, as a run over a task leaves it (members/prefix.py).",
        "",
        "| task | prompt tokens | scored rows | cold prefill s | cold prefill + scoring s | cold extra s "
        "| cold request s | cold extra / request | warm prefill s | warm prefill + scoring s | warm extra s "
        "| warm request s | warm extra / request | cold extra, layers unplanned |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {'/'.join(map(str, r['prompt_tokens']))} | {'/'.join(map(str, r['scored_positions']))} "
            f"| {pair(r['prefill_s'])} | {pair(r['scored_prefill_s'])} | {r['extra_s']:+.3f} | {r['request_s']:.2f} "
            f"| {r['extra_fraction_of_request']:.1%} | {pair(r['warm_prefill_s'])} "
            f"| {pair(r['warm_scored_prefill_s'])} "
            f"| {r['warm_extra_s']:+.3f} | {r['warm_request_s']:.2f} | {r['warm_extra_fraction_of_request']:.1%} "
            f"| {r['extra_unpadded_s']:+.3f} ({r['extra_unpadded_s'] / r['request_s']:.1%}) |"
        )

    def summary(prefix):  # "" (cold) or "warm_": the mean fraction and the pooled one
        mean = statistics.mean(r[prefix + "extra_fraction_of_request"] for r in rows)
        pooled = sum(r[prefix + "extra_s"] for r in rows) / sum(r[prefix + "request_s"] for r in rows)
        return f"mean {mean:.1%}, pooled {pooled:.1%}"

    mean_unplanned = statistics.mean(r["extra_unpadded_s"] / r["request_s"] for r in rows)
    lines += [
        "",
        f"Output layers' plans (members/headpad.py, timed at load; unplanned: every layer's plan undone): {pads}.",
        "",
        f"Extra over a whole request, cold: {summary('')} (layers unplanned: "
        f"mean {mean_unplanned:.1%}); warm: {summary('warm_')} "
        "(pooled: the extra time of all seven over their requests' time).",
        "",
        f"Command: `python benchmarks/evidence_cost.py --repeats {args.repeats} --out {args.out}`",
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def _prefixes(member, max_bytes: int):
    """The member's prompt prefix store emptied and bounded at max_bytes inside the block (0: off)."""
    kept, member.prefixes = member.prefixes, PrefixCache(max_bytes)
    try:
        yield
    finally:
        member.prefixes = kept


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _scored(m, ids, pos) -> None:
    m.score_prompt(ids, pos)
    m.prefill(ids)  # the hand-over: no second forward


if __name__ == "__main__":
    main()
