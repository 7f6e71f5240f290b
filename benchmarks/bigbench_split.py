"""The frozen tune / outside split of BIG-bench tasks, and their task files for `ensemble-llm bench`.

Every choice about member weights is made on the *tune* half and the bundled dev suite; the
*outside* half is scored once, for the final candidates, and its figures are the headline ones.

Which tasks (fixed before any model ran on them; `benchmarks/results/bigbench_split/split.json`):
- every task (or subtask) of the `bigbench` 1.0.0 sdist on PyPI whose metrics include
  `exact_str_match` and that has at least 60 examples with string targets;
- short answers: at least 90% of the first targets are one line of at most 40 characters;
- prompts that fit a small model: the 90th percentile of the inputs is at most 700 characters;
- not the dev suite's tasks (they ship in `ensemble_llm/data/`) nor their subsets
  (`plural_regular_json` is part of `plural_json`, ...);
- a family (the first folder: `arithmetic`, `color`, ...) gives at most `PER_FAMILY` subtasks, the
  first by a fixed hash of their names, so that 19 arithmetic subtasks do not make the pool.

The split is by family, so that no family's siblings sit on both sides (a rule tuned on 2-digit
addition would be checked on 3-digit addition): the families, in the order of a fixed hash of
their names, go to the tune and outside halves in turn. The families that earlier checks already
looked at (`benchmarks/outside_tasks.py`, in git history: `git show 7aee0d6:benchmarks/outside_tasks.py`:
linguistic_mappings) come first, so they are tuned on.

Each task file holds its examples shuffled with a fixed seed. Line 1-3 are the fixed shots (the
reading most users have: one prompt's three examples), each later line is an example to score
and carries `shots`: three other examples of the task drawn for it with a fixed seed (the reading
over many shot sets). A task's own `task_prefix` (BIG-bench's instruction, e.g. the penguins'
table) is kept as `prefix`. `ensemble-llm bench --shots drawn` reads the drawn shots.

    python benchmarks/bigbench_split.py --out /tmp/bb                  # pip-downloads the sdist
    python benchmarks/bigbench_split.py --sdist bigbench-1.0.0.tar.gz --out /tmp/bb

writes /tmp/bb/tune/*.jsonl and /tmp/bb/outside/*.jsonl, and checks (or, with --write-split,
writes) the committed split.json; /tmp/bb/dev/*.jsonl are the bundled dev suite's tasks in the
same form (their instruction as the prefix, drawn shots), which choices are tuned on too.
The BIG-bench data carries its canary string; it must never be used for training.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SPLIT = Path(__file__).parent / "results" / "bigbench_split" / "split.json"
ROOT = "bigbench-1.0.0/bigbench/benchmark_tasks/"
SALT = "ensemble_llm-split-2026-12-03"
MIN_EXAMPLES, SHORT_CHARS, SHORT_SHARE, INPUT_P90 = 60, 40, 0.9, 700
PER_FAMILY = 3
EXAMPLES = 100  # scored per task (fewer when the task is smaller: it keeps 10 for shots)
SHOTS, SEED = 3, 11
# the dev suite's tasks and the subtasks whose examples are theirs
DEV = {
    "qa_wikidata",
    "periodic_elements/subtask_0",
    "periodic_elements/subtask_1",
    "tense",
    "object_counting",
    "linguistic_mappings/plural_json",
    "linguistic_mappings/plural_regular_json",
    "linguistic_mappings/plural_irregular_json",
    "linguistic_mappings/question_formation_json",
    "linguistic_mappings/de_past_tense_json",
    "linguistic_mappings/de_past_tense_regular_json",
    "linguistic_mappings/de_past_tense_irregular_json",
}
SEEN = {"linguistic_mappings"}  # families earlier outside checks used: tune half


def digest(text: str) -> int:
    return int(hashlib.sha256(f"{SALT}:{text}".encode()).hexdigest()[:12], 16)


def examples_of(task: dict) -> list[dict]:
    out = []
    for e in task.get("examples", []):
        t = e.get("target")
        targets = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []
        if isinstance(e.get("input"), str) and targets and targets[0].strip():
            out.append({"input": e["input"], "targets": targets})
    return out


def eligible(name: str, task: dict, examples: list[dict]) -> bool:
    if name in DEV or "exact_str_match" not in task.get("metrics", []) or len(examples) < MIN_EXAMPLES:
        return False
    first = [e["targets"][0].strip() for e in examples]
    short = sum(len(t) <= SHORT_CHARS and "\n" not in t for t in first) / len(first)
    lengths = sorted(len(e["input"]) for e in examples)
    return short >= SHORT_SHARE and lengths[int(0.9 * (len(lengths) - 1))] <= INPUT_P90


def read_tasks(sdist: Path) -> dict[str, tuple[dict, list[dict]]]:
    """name -> (task.json, its examples), every eligible task of the sdist."""
    found = {}
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            if not (m.name.startswith(ROOT) and m.name.endswith("/task.json")):
                continue
            name = m.name[len(ROOT) : -len("/task.json")]
            try:
                task = json.load(tar.extractfile(m))
            except (ValueError, UnicodeDecodeError):
                continue
            examples = examples_of(task)
            if eligible(name, task, examples):
                found[name] = (task, examples)
    return found


def choose(names: list[str]) -> dict[str, list[str]]:
    """family -> its chosen subtasks (at most PER_FAMILY, by hash)."""
    families: dict[str, list[str]] = {}
    for name in names:
        families.setdefault(name.split("/")[0], []).append(name)
    return {f: sorted(sorted(ts, key=digest)[:PER_FAMILY]) for f, ts in sorted(families.items())}


def halves(families: list[str]) -> dict[str, str]:
    """family -> "tune" or "outside": the families in the order of their hashes (the SEEN ones
    first) go to the two halves in turn, so each half gets every other family."""
    order = sorted(families, key=lambda f: (f not in SEEN, digest(f)))
    return {f: ("tune", "outside")[k % 2] for k, f in enumerate(order)}


def task_lines(name: str, task: dict, examples: list[dict]) -> list[dict]:
    """The task file: 3 fixed shots, then the scored examples, each with drawn shots."""
    rows = list(examples)
    random.Random(f"{SEED}:{name}").shuffle(rows)
    prefix = (task.get("task_prefix") or "").strip()
    n = min(EXAMPLES, len(rows) - SHOTS - 10)
    lines = []
    for i, row in enumerate(rows[: SHOTS + n]):
        line = dict(row)
        if prefix:
            line["prefix"] = prefix
        if i >= SHOTS:  # three others, drawn for this example (any but itself)
            rng = random.Random(f"{SEED}:{name}:{i}")
            others = rng.sample([j for j in range(len(rows)) if j != i], SHOTS)
            line["shots"] = [{"input": rows[j]["input"], "target": rows[j]["targets"][0]} for j in others]
        lines.append(line)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sdist", help="bigbench-1.0.0.tar.gz (default: pip download it)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--write-split", action="store_true", help="write split.json instead of checking it")
    args = ap.parse_args()
    sdist = Path(args.sdist) if args.sdist else _download()
    found = read_tasks(sdist)
    split = {"tune": [], "outside": []}
    files = {}
    chosen = choose(sorted(found))
    half = halves(list(chosen))
    for family, names in chosen.items():
        for name in names:
            task, examples = found[name]
            lines = task_lines(name, task, examples)
            split[half[family]].append({"task": name, "family": family, "examples": len(lines) - SHOTS})
            files[name] = (half[family], lines)
    record = {
        "sdist_sha256": hashlib.sha256(sdist.read_bytes()).hexdigest(),
        "criteria": {
            "min_examples": MIN_EXAMPLES,
            "short_answer_chars": SHORT_CHARS,
            "short_share": SHORT_SHARE,
            "input_p90_chars": INPUT_P90,
            "per_family": PER_FAMILY,
            "examples_per_task": EXAMPLES,
            "salt": SALT,
            "dev_suite_excluded": sorted(DEV),
            "families_to_tune": sorted(SEEN),
        },
        "eligible_tasks": sorted(found),
        **split,
    }
    _check_or_write(record, args.write_split)
    out = Path(args.out)
    for name, (half, lines) in files.items():
        path = out / half / (name.replace("/", "__") + ".jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines), encoding="utf-8")
    for half in ("tune", "outside"):
        n = sum(t["examples"] for t in split[half])
        print(f"{half}: {len(split[half])} tasks, {n} examples -> {out / half}")
    write_dev(out / "dev")


def write_dev(folder: Path) -> None:
    """The bundled dev suite's tasks as task files with drawn shots (their instruction as prefix)."""
    from ensemble_llm.bench import INSTRUCTIONS, SUITE, bundled_task

    folder.mkdir(parents=True, exist_ok=True)
    for name in SUITE:
        rows = [json.loads(x) for x in bundled_task(name).read_text().splitlines() if x.strip()]
        lines = task_lines(
            name, {"task_prefix": INSTRUCTIONS[name]}, [{"input": r["input"], "targets": r["targets"]} for r in rows]
        )
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    print(f"dev: {len(SUITE)} tasks -> {folder}")


def _check_or_write(record: dict, write: bool) -> None:
    if write or not SPLIT.exists():
        SPLIT.parent.mkdir(parents=True, exist_ok=True)
        SPLIT.write_text(json.dumps(record, indent=1) + "\n")
        return
    committed = json.loads(SPLIT.read_text())
    if committed != record:
        sys.exit(f"the tasks differ from the committed split ({SPLIT}); it is frozen: rerun with the same sdist")


def _download() -> Path:
    where = Path(tempfile.mkdtemp(prefix="bigbench-"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(where)]
    subprocess.run([*cmd, "bigbench==1.0.0"], check=True)
    return next(where.glob("bigbench-1.0.0.tar.gz"))


if __name__ == "__main__":
    main()
