"""How far do the shown answers of a few-shot prompt tell which member is right on the question?

Per example of the given task files (the tune half of `bigbench_split.py`, both shot readings),
for every member of the pair:
- the evidence the engine reads (`evidence.py`): the mean log-probability per shown answer, from
  the prompt's own prefill (`TokenLM.score_prompt` at `answer_positions`);
- its greedy answer (`method="single"`, the bench's budget, stop at the newline) and whether it is
  right (the bench's exact match);
- every member's log-probability of every member's answer (its " answer\\n" tokens: what
  specfuse's verifiers score), so that weighting rules can be compared offline.

`collect` appends one JSON line per example to `--out/examples.jsonl` (a rerun skips what is
there); with --skip-floor N a task is left after N examples where no member was right (they
tell neither member from the other); weights_analysis.py reads them.

    python benchmarks/weights_reliability.py --tasks /tmp/bb/tune/*.jsonl --shots drawn fixed \\
        --out benchmarks/results/weights_reliability
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ensemble_llm import Ensemble
from ensemble_llm.bench import norm, task_prompts
from ensemble_llm.evidence import answer_positions, answer_spans

PAIR = ("smollm2-135m-instruct", "gemma-3-270m")


def evidence(member, text: str) -> tuple[float | None, int]:
    """(mean log-prob per shown answer, answers shown) as `evidence.request_weights` reads it."""
    ids = member.prompt_ids(text)
    spans = answer_spans(text)
    positions = answer_positions(member, text, ids, spans)
    if not positions:
        return None, len(spans)
    scores = member.score_prompt(ids, positions)
    member.forget_prompt(ids)
    return float(sum(s.logprob for s in scores)) / len(spans), len(spans)


def candidate_score(member, prompt: str, text: str) -> tuple[float, int]:
    """(sum log-prob, tokens) of `text`'s canonical tokens after the prompt (its KV reused)."""
    ids = member.encode(text)
    state = member.prefill(member.prompt_ids(prompt))
    first = float(state.next_logprobs[ids[0]])
    if len(ids) == 1:
        return first, 1
    with member.scratch(state):
        rows = member.extend(state, ids[:-1])
    return first + float(sum(rows[i, t] for i, t in enumerate(ids[1:]))), len(ids)


def one_example(singles: list[Ensemble], prompt: str, ex: dict, budget: int) -> dict:
    members = singles[0].members
    row: dict = {"answers": [], "right": [], "evidence": [], "scores": []}
    for eng in singles:
        res = eng.generate(prompt, max_new_tokens=budget, raw=True, stop=["\n"])
        row["answers"].append(res.text)
        row["right"].append(int(norm(res.text) in {norm(t) for t in ex["targets"]}))
    for m in members:
        e, n = evidence(m, prompt)
        row["evidence"].append(e)
        row["shown"] = n
        row["scores"].append([candidate_score(m, prompt, a + "\n") for a in row["answers"]])
    return row


def collect(task_files: list[Path], readings: list[str], out: Path, examples: int, skip_floor: int = 0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "examples.jsonl"
    done = set()
    if path.exists():
        done = {(r["task"], r["shots"], r["i"]) for r in map(json.loads, path.read_text().splitlines())}
    singles = [Ensemble(list(PAIR), "single", {"member": i}, progress=False) for i in range(len(PAIR))]
    members = singles[0].members
    assert all(a is b for eng in singles[1:] for a, b in zip(eng.members, members))  # loaded once per process
    with path.open("a") as fh:
        for f in task_files:
            task = f.stem
            for reading in readings:
                prompts = task_prompts(f, examples, reading)
                longest = max(len(members[0].encode(t)) for _, ex in prompts for t in ex["targets"])
                budget = min(64, longest + 4)  # the bench's budget (bench/run.py)
                t0, right = time.perf_counter(), 0
                for i, (prompt, ex) in enumerate(prompts):
                    if skip_floor and i == skip_floor and not right:
                        break  # both members at the floor: these examples tell no member from the other
                    if (task, reading, i) in done:
                        right += 1  # (already collected: not counted for the floor)
                        continue
                    row = {"task": task, "shots": reading, "i": i, **one_example(singles, prompt, ex, budget)}
                    right += sum(row["right"])
                    fh.write(json.dumps(row) + "\n")
                    fh.flush()
                print(f"{task} {reading}: {len(prompts)} examples, {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", nargs="+", required=True, type=Path)
    ap.add_argument("--shots", nargs="+", default=["drawn", "fixed"], choices=["drawn", "fixed"])
    ap.add_argument("--examples", type=int, default=100)
    ap.add_argument(
        "--skip-floor", type=int, default=0, help="leave a task once this many examples had no member right"
    )
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    collect(args.tasks, args.shots, args.out, args.examples, args.skip_floor)


if __name__ == "__main__":
    main()
