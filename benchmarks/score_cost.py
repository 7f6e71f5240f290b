"""What scoring a multiple-choice question costs (issue 61: at most 1.5x the sum of its members
scoring it alone on llama.cpp).

Each configuration runs in a fresh process on the bundled pair on llama.cpp, over the same
questions (few-shot prompts of a dev task, its answer and three other answers of the task as the
choices):
- `ensemble`: `Ensemble.score(prompt, 4 choices)` with the default method (byte-level, scoring.py);
- `member:K`: member K alone scoring each choice's tokens after the prompt, as llama-cpp-python
  would (one prefill of the prompt, then each choice's tokens: `target_logprob`).
The figure is the ensemble's seconds per question over the sum of the members' (medians of the
rounds, configurations alternating).

    python benchmarks/score_cost.py --task /tmp/dev/qa_wikidata.jsonl --questions 8 --rounds 3 \
        --out benchmarks/results/score_cost
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PAIR = ["smollm2-135m-instruct", "gemma-3-270m"]


def questions(task: str, n: int) -> list[tuple[str, list[str]]]:
    """(prompt, four choices: the answer first) for the task's first n drawn prompts."""
    from ensemble_llm.bench import task_prompts

    rows = [(p, ex["targets"][0]) for p, ex in task_prompts(Path(task), n + 20, "drawn")]
    answers = sorted({a for _, a in rows})
    rng = random.Random(0)
    out = []
    for prompt, answer in rows[:n]:
        others = rng.sample([a for a in answers if a != answer], 3)
        out.append((prompt, [" " + answer] + [" " + o for o in others]))
    return out


def child(config: str, task: str, n: int) -> dict:
    from ensemble_llm import Ensemble

    qs = questions(task, n)
    if config == "ensemble":
        eng = Ensemble(PAIR).load()
        run = lambda p, cs: eng.score(p, cs)  # noqa: E731
    else:
        eng = Ensemble([PAIR[int(config.split(":")[1])]], method="single").load()
        m = eng.members[0]
        m.prefixes.max_bytes = 0  # every prompt whole, as the first question of a task

        def run(p, cs):  # the prompt once, then each choice's tokens on its state (llama-cpp-python's prefix reuse)
            state, out = m.prefill(m.prompt_ids(p)), []
            for c in cs:
                ids = m.encode(c)
                lp = float(m.ensure_next(state)[ids[0]])
                with m.scratch(state):
                    rows = m.extend(state, ids)
                out.append(lp + sum(float(rows[i][ids[i + 1]]) for i in range(len(ids) - 1)))
            return out

    times = []
    for p, cs in qs:
        t0 = time.perf_counter()
        run(p, cs)
        times.append(time.perf_counter() - t0)
    eng.close()
    return {"seconds": times}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", required=True)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.task, args.questions)))
        return
    configs, rounds = ["ensemble", "member:0", "member:1"], []
    for r in range(args.rounds):
        got = {}
        for c in configs[r % 3 :] + configs[: r % 3]:
            cmd = [sys.executable, __file__, "--child", c, "--task", args.task, "--questions", str(args.questions)]
            got[c] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        ens = statistics.mean(got["ensemble"]["seconds"])
        alone = statistics.mean(got["member:0"]["seconds"]) + statistics.mean(got["member:1"]["seconds"])
        rounds.append({"runs": got, "ensemble_s": ens, "members_s": alone, "ratio": ens / alone})
        print(r, round(ens, 3), round(alone, 3), round(ens / alone, 2), flush=True)
    ratio = statistics.median(x["ratio"] for x in rounds)
    record = {"command": " ".join(sys.argv), "pair": PAIR, "rounds": rounds, "ratio_median": ratio}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
        lines = [
            "# What scoring a 4-choice question costs",
            "",
            f"`{record['command']}`: each configuration a fresh process, the bundled pair on llama.cpp.",
            "",
            "| round | ensemble, s per question | members alone, summed | ratio |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {i} | {x['ensemble_s']:.3f} | {x['members_s']:.3f} | {x['ratio']:.2f} |" for i, x in enumerate(rounds)
        ]
        lines += ["", f"Median ratio: {ratio:.2f} (the issue's bound: 1.5)."]
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print(json.dumps({"ratio_median": ratio}))


if __name__ == "__main__":
    main()
