"""Task files from BIG-bench that are not in this repo, for checking the dev suite's figures on
tasks nobody tuned on: `ensemble-llm bench --tasks` takes them as files (bare "Q:/A:" shots, no
instruction line: what a user's own task file gets).

The tasks come from the `bigbench` 1.0.0 package on PyPI (Apache License 2.0; its sdist holds
every task's task.json, about 360 MB): five generative, exact-match tasks, none of them in
`ensemble_llm/data/`: four others and qa_wikidata's questions that the bundled dev file does not
hold. Each task's examples are shuffled with a fixed seed; the first three lines are the shots.

    python benchmarks/outside_tasks.py --out /tmp/outside            # pip-downloads the sdist
    python benchmarks/outside_tasks.py --sdist bigbench-1.0.0.tar.gz --out /tmp/outside
    ensemble-llm bench --methods single unite safe specfuse --speed-prompts 0 \\
        --tasks /tmp/outside/*.jsonl:80 --out benchmarks/results/outside

The BIG-bench data carries its canary string; it must never be used for training.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ensemble_llm.bench import bundled_task

# name -> the task's folder in bigbench/benchmark_tasks
TASKS = {
    "auto_categorization": "auto_categorization",
    "past_tense": "linguistic_mappings/past_tense_json",
    "pronoun_replacement": "linguistic_mappings/pronoun_replacement_json",
    "qa_wikidata_outside": "qa_wikidata",
    "sentence_negation": "linguistic_mappings/sentence_negation_json",
}
SEED, LINES = 7, 203


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sdist", help="bigbench-1.0.0.tar.gz (default: pip download it)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sdist = Path(args.sdist) if args.sdist else _download()
    bundled = {json.loads(x)["input"] for x in bundled_task("qa_wikidata").read_text().splitlines() if x.strip()}
    with tarfile.open(sdist) as tar:
        for name, folder in TASKS.items():
            member = f"bigbench-1.0.0/bigbench/benchmark_tasks/{folder}/task.json"
            examples = json.load(tar.extractfile(member))["examples"]
            rows = []
            for e in examples:
                target = e.get("target")
                targets = [target] if isinstance(target, str) else target
                if targets and e["input"] not in bundled:  # qa_wikidata: not in the bundled dev file
                    rows.append({"input": e["input"], "targets": targets})
            random.Random(SEED).shuffle(rows)
            path = out / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows[:LINES]))
            print(f"{path}: {min(LINES, len(rows))} of {len(rows)} examples")


def _download() -> Path:
    where = Path(tempfile.mkdtemp(prefix="bigbench-"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(where)]
    subprocess.run([*cmd, "bigbench==1.0.0"], check=True)
    return next(where.glob("bigbench-1.0.0.tar.gz"))


if __name__ == "__main__":
    main()
