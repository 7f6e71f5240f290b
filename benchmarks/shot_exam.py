"""The shot exam's findings per example (evidence.py): for each member and each answer the prompt
shows, how far the member is from writing it greedily given what comes before it, read from the
prompt's prefill as the engine reads it (`score_prompt`'s gaps). The first shown answer is
recorded too, though the engine does not examine it; and the copy test: whether each member's
greedy reply to the query is the query's question itself (`query_copy`; null where the prompt has
none). Joined with the bench's per-example hits, this tells what a rule would have done without
running the ensemble again (a request a rule sends to one member gets that member's own greedy
answer, which the bench's single runs hold).

    python benchmarks/shot_exam.py --tasks /tmp/floor/capital_of.jsonl:100 --shots fixed --out R.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ensemble_llm import Ensemble  # noqa: E402
from ensemble_llm.bench import resolve_tasks, task_prompts  # noqa: E402
from ensemble_llm.evidence import answer_spans, copy_tokens, span_groups  # noqa: E402

PAIR = ("smollm2-135m-instruct", "gemma-3-270m")


def exam(member, prompt: str) -> list[dict]:
    """Per shown answer: the sum of its tokens' gaps to the best token (0: the member writes it)."""
    ids = member.prompt_ids(prompt)
    groups = span_groups(member, prompt, ids, answer_spans(prompt))
    if not groups:
        return []
    want = sorted({p for g in groups for p in g})
    got = dict(zip(want, member.score_prompt(ids, want)))
    member.forget_prompt(ids)
    return [{"gap": round(sum(got[p].gap for p in g), 4)} for g in groups]


def copies(members, prompt: str) -> list[bool] | None:
    """Per member: whether it writes the copy of the query's question greedily (as the engine tests it)."""
    ids = [m.prompt_ids(prompt) for m in members]
    tails = copy_tokens(members, [prompt] * len(members), ids, True)
    if tails is None:
        return None
    out = []
    for m, a, tail in zip(members, ids, tails):
        m.score_prompt(a, [])
        out.append(m.greedy_after(a, tail))
        m.forget_prompt(a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", nargs="+", required=True)
    ap.add_argument("--shots", default="fixed")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    members = Ensemble(list(PAIR), method="specfuse").load().members
    with args.out.open("w") as f:
        for path, n in resolve_tasks(args.tasks, 100):
            task = path.stem.removesuffix("_dev")
            for i, (prompt, _) in enumerate(task_prompts(path, n, args.shots)):
                row = {"task": task, "shots": args.shots, "i": i, "exam": [exam(m, prompt) for m in members]}
                row["copy"] = copies(members, prompt)
                f.write(json.dumps(row) + "\n")
            print(task, flush=True)


if __name__ == "__main__":
    main()
