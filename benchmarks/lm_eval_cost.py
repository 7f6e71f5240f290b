"""lm-evaluation-harness against `ensemble-llm serve`, as a researcher runs it (issue 72): what a
multiple-choice question costs, and whether one member through the server ranks choices as
llama.cpp itself does.

The questions: MMLU (`mc_accuracy.py`'s data, split and 0-shot prompt, lm-eval's
`mmlu_<subject>_continuation`), `--per-topic` questions of each subject of the outside half.
Each configuration runs in a fresh process, one llama.cpp process at a time:
- `serve:pair`: `ensemble-llm serve` with the bundled pair and the default method, and lm-eval's
  `local-completions` with `tokenizer_backend=remote` on it (`--batch-size` prompts a request);
- `serve:smollm2`: the same with SmolLM2-135M alone (method `single`), one request at a time
  (batch size 1), so that no other request shares its forwards: on llama.cpp a forward's figures
  move with what it is batched with;
- `llama:K`: llama-cpp-python on member K's GGUF scoring what lm-eval asks: the context's tokens
  once, then each choice's tokens on its KV (llama-cpp-python's prefix reuse), the choice's summed
  log-probabilities, with flash attention on as llama.cpp's own default ("auto") runs it here and
  the members run (llama-cpp-python turns it off unless asked). The members alone, their two
  times summed, are the bound.
Times are the harness's whole run (lm-eval's own work included) or llama-cpp-python's loop, model
loading left out. The report: seconds per question, the pair over the members' sum, and
SmolLM2's pick through the server against llama.cpp's on every question.

    python benchmarks/lm_eval_cost.py run --per-topic 4 --out benchmarks/results/lm_eval_cost
    python benchmarks/lm_eval_cost.py report --out benchmarks/results/lm_eval_cost
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # helpers.start_server: a real server process
os.environ.setdefault("HF_HUB_OFFLINE", "1")
PAIR = ["smollm2-135m-instruct", "gemma-3-270m"]
CONFIGS = ["serve:pair", "serve:smollm2", "llama:0", "llama:1"]
TASK = """task: mmlu_cost
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
"""


def mmlu(per_topic: int) -> list[dict]:
    """The outside half's questions (mc_accuracy.py), choices without their leading space: lm-eval
    puts `target_delimiter` before each, and the context's trailing space moves there anyway."""
    from mc_accuracy import check_split, load_rows, questions

    rows, digest = load_rows(None)
    halves = check_split(Path(__file__).parent / "results" / "mc_accuracy", rows, digest)
    return questions(rows, halves["outside"], per_topic)


def harness(models: list[str], method: str, qs: list[dict], batch: int) -> dict:
    """lm-eval's run against a served ensemble: seconds, and per question the choices' log-likelihoods."""
    import lm_eval
    from helpers import start_server
    from lm_eval.tasks import TaskManager

    root = Path(tempfile.mkdtemp())
    data = root / "mmlu.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in qs))
    (root / "mmlu_cost.yaml").write_text(TASK.format(data=data))
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    proc, base = start_server(models, method)
    try:
        args = {"model": "ensemble", "base_url": base + "/v1/completions", "tokenizer_backend": "remote"}
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=args,
            tasks=["mmlu_cost"],
            task_manager=TaskManager(include_path=str(root)),
            batch_size=batch,
            log_samples=True,
        )
        seconds = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    samples = sorted(out["samples"]["mmlu_cost"], key=lambda s: s["doc_id"])
    lls = [[r[0][0] for r in s["resps"]] for s in samples]
    return {"seconds": seconds, "lls": lls, "acc": out["results"]["mmlu_cost"]["acc,none"]}


def llama(k: int, qs: list[dict]) -> dict:
    """Member k on llama-cpp-python: the context once, each choice's tokens on its KV."""
    import llama_cpp
    import numpy as np

    from ensemble_llm.members.backends.llama_cpp.member import cpu_cores
    from ensemble_llm.members.loader import gguf_file, resolve_source

    llm = llama_cpp.Llama(
        str(gguf_file(resolve_source(PAIR[k]))),
        n_ctx=2048,
        n_threads=cpu_cores(),
        logits_all=True,
        flash_attn=True,
        verbose=False,
    )
    t0, lls = time.perf_counter(), []
    for q in qs:
        ctx = llm.tokenize(q["prompt"].encode(), add_bos=True, special=False)
        llm.reset()
        llm.eval(ctx)
        row = []
        for c in q["choices"]:
            whole = llm.tokenize((q["prompt"] + c).encode(), add_bos=True, special=False)
            cont = whole[len(ctx) :]
            llm.n_tokens = len(ctx)
            llm.eval(cont)
            scores = np.asarray(llm.scores[len(ctx) - 1 : len(ctx) - 1 + len(cont)], dtype=np.float64)
            logz = np.logaddexp.reduce(scores, axis=1)
            row.append(float(sum(scores[i, t] - logz[i] for i, t in enumerate(cont))))
        lls.append(row)
    return {"seconds": time.perf_counter() - t0, "lls": lls}


def child(config: str, per_topic: int, batch: int) -> dict:
    qs = mmlu(per_topic)
    kind, what = config.split(":")
    if kind == "llama":
        return llama(int(what), qs)
    if what == "pair":
        return harness(PAIR, "specfuse", qs, batch)
    return harness([PAIR[0]], "single", qs, 1)


def run(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    for config in args.configs:
        path = args.out / f"{config.replace(':', '_')}.json"
        if path.exists():
            continue
        cmd = [sys.executable, __file__, "child", config, "--per-topic", str(args.per_topic)]
        cmd += ["--batch-size", str(args.batch_size)]
        got = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
        batch = 1 if config == "serve:smollm2" else args.batch_size
        record = {"config": config, "per_topic": args.per_topic, "batch_size": batch, **json.loads(got)}
        path.write_text(json.dumps(record) + "\n")
        print(config, round(record["seconds"], 1), flush=True)


def report(args: argparse.Namespace) -> None:
    runs = {c: json.loads((args.out / f"{c.replace(':', '_')}.json").read_text()) for c in CONFIGS}
    qs = mmlu(runs["serve:pair"]["per_topic"])
    n = len(qs)
    per_q = {c: r["seconds"] / n for c, r in runs.items()}
    members = per_q["llama:0"] + per_q["llama:1"]
    pick = lambda lls: [max(range(len(x)), key=x.__getitem__) for x in lls]  # noqa: E731
    acc = {c: sum(p == q["gold"] for p, q in zip(pick(r["lls"]), qs)) / n for c, r in runs.items()}
    served, own = pick(runs["serve:smollm2"]["lls"]), pick(runs["llama:0"]["lls"])
    differ = [q["id"] for q, a, b in zip(qs, served, own) if a != b]
    gaps = [abs(a - b) for x, y in zip(runs["serve:smollm2"]["lls"], runs["llama:0"]["lls"]) for a, b in zip(x, y)]
    record = {
        "questions": n,
        "seconds_per_question": per_q,
        "pair_over_members": per_q["serve:pair"] / members,
        "thousand_questions_minutes": per_q["serve:pair"] * 1000 / 60,
        "thousand_questions_members_minutes": members * 1000 / 60,
        "accuracy": acc,
        "smollm2_picks_differ": differ,
        "smollm2_largest_gap_nats": max(gaps),
        "smollm2_median_gap_nats": statistics.median(gaps),
        "smollm2_gaps_over_0.01": sum(g > 0.01 for g in gaps),
        "choices": len(gaps),
    }
    (args.out / "report.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        "# lm-evaluation-harness against `serve`: cost and agreement",
        "",
        f"MMLU, outside half, {n} questions (4 choices, 0-shot), lm-eval's `local-completions` with "
        f"`tokenizer_backend=remote`, batch size {runs['serve:pair']['batch_size']} for the pair and "
        f"{runs['serve:smollm2']['batch_size']} for SmolLM2 alone; each configuration a fresh process on this machine.",
        "",
        "| configuration | seconds per question | accuracy |",
        "|---|---|---|",
    ]
    lines += [f"| {c} | {per_q[c]:.3f} | {acc[c]:.3f} |" for c in CONFIGS]
    lines += [
        "",
        f"The pair through lm-eval costs {record['pair_over_members']:.2f}x the members alone on "
        f"llama-cpp-python (summed); 1,000 questions would take {record['thousand_questions_minutes']:.1f} minutes, "
        f"and {record['thousand_questions_members_minutes']:.1f} minutes with the two members alone.",
        f"SmolLM2 through the server picks as llama.cpp does on {n - len(differ)} of {n} questions "
        f"(log-likelihood gaps: median {record['smollm2_median_gap_nats']:.1g} nats, "
        f"{record['smollm2_gaps_over_0.01']} of {len(gaps)} choices over 0.01, largest "
        f"{record['smollm2_largest_gap_nats']:.2g}).",
    ]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    assert all(math.isfinite(v) for v in per_q.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "report", "child"):
        p = sub.add_parser(name)
        if name == "child":
            p.add_argument("config")
        p.add_argument("--per-topic", type=int, default=4)
        p.add_argument("--batch-size", type=int, default=4)
        p.add_argument("--out", type=Path, default=Path("benchmarks/results/lm_eval_cost"))
        p.add_argument("--configs", nargs="+", default=CONFIGS)
    args = ap.parse_args()
    if args.cmd == "child":
        print(json.dumps(child(args.config, args.per_topic, args.batch_size)))
    elif args.cmd == "run":
        run(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
