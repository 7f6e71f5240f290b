"""int8 members against fp32 on the bundled pair, per method, side by side in one run.

Both members (smollm2-135m-instruct, gemma-3-270m) are loaded twice in this process: fp32, and
int8 (quantization="int8": torchao's weight-only int8, per-channel weights, on the CPU). Every
method runs as an fp32 engine and an int8 engine, interleaved prompt by prompt so machine noise
hits both alike:
- speed: the chat speed prompts (ensemble_llm.bench.SPEED_PROMPTS), `--tokens` new tokens each,
  greedy; seconds per output token of each engine;
- quality: the dev suite (ensemble_llm.bench.SUITE), `--per-task` examples per task, raw 3-shot
  "Q:/A:" prompts, greedy, stop "\\n", exact match after `norm`, the budget of
  ensemble_llm.bench.run._task_quality; examples are visited round-robin over tasks (example i of
  every task before example i+1), so a run stopped early (--minutes) stays balanced. Reported: the
  pooled accuracy of each, the int8-minus-fp32 difference with its paired-bootstrap 95% interval,
  and the fraction of examples whose int8 text equals the fp32 text.
results.json and results.md are rewritten after every round, so an interrupted run keeps what it
measured. `--rss` instead measures each setting's peak resident memory in a process of its own
(load the pair, answer one speed prompt) and writes rss.json.

    python benchmarks/quantized.py --out benchmarks/results/quantized
    python benchmarks/quantized.py --rss --out benchmarks/results/quantized
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PAIR = ("smollm2-135m-instruct", "gemma-3-270m")
METHODS = ("single-0", "single-1", "unite", "safe", "specfuse")
SETTINGS = ("fp32", "int8")


def engines(methods):
    out = {}
    for setting in SETTINGS:
        out.update(engines_of(methods, setting))
    return out


def engines_of(methods, setting: str) -> dict:
    from ensemble_llm import Ensemble

    out = {}
    members = list(PAIR) if setting == "fp32" else [{"model": m, "quantization": "int8"} for m in PAIR]
    for method in methods:
        if method.startswith("single-"):
            eng = Ensemble([members[int(method[-1])]], method="single")
        elif method.startswith("smc"):
            eng = Ensemble(members, method="smc", config={"n_particles": 4})
        else:
            eng = Ensemble(members, method=method)
        out[(method, setting)] = eng
    return out


def speed(engs, methods, prompts: int, tokens: int) -> dict:
    from ensemble_llm.bench import SPEED_PROMPTS

    out = {f"{m}/{s}": {"time": 0.0, "tokens": 0, "texts": []} for m in methods for s in SETTINGS}
    for p in SPEED_PROMPTS[:prompts]:
        for m in methods:
            for s in SETTINGS:
                r = engs[(m, s)].generate(p, max_new_tokens=tokens)
                row = out[f"{m}/{s}"]
                row["time"] += r.stats["time_s"]
                row["tokens"] += r.stats.get("tokens_out", 0)
                row["texts"].append(r.text)
        print(f"speed prompt done: {p!r}", flush=True)
    return out


def quality_round(engs, methods, tasks: dict, i: int, hits: dict, texts: dict) -> None:
    from ensemble_llm.bench import norm

    for task, (shots, exs, budget) in tasks.items():
        if i >= len(exs):
            continue
        ex = exs[i]
        prompt = shots + f"Q: {ex['input'].strip()}\nA:"
        gold = {norm(t) for t in ex["targets"]}
        for m in methods:
            for s in SETTINGS:
                out = engs[(m, s)].generate(prompt, max_new_tokens=budget, raw=True, stop=["\n"]).text
                hits[f"{m}/{s}"].setdefault(task, []).append(int(norm(out) in gold))
                texts[f"{m}/{s}"].setdefault(task, []).append(out)


def load_tasks(per_task: int, main_tokenizer) -> dict:
    from ensemble_llm.bench import SUITE, bundled_task, load_task

    tasks = {}
    for name in SUITE:
        shots, exs = load_task(bundled_task(name), per_task)
        longest = max(len(main_tokenizer.encode(t)) for ex in exs for t in ex["targets"])
        tasks[name] = (shots, exs, min(64, longest + 4))  # the budget of bench.run._task_quality
    return tasks


def summarize(methods, sp: dict, hits: dict, texts: dict) -> dict:
    from ensemble_llm.bench import bootstrap_diff

    rows = {}
    for m in methods:
        f, q = f"{m}/fp32", f"{m}/int8"
        row = {}
        if sp:
            for s, k in (("fp32", f), ("int8", q)):
                row[f"s_per_token_{s}"] = sp[k]["time"] / max(1, sp[k]["tokens"])
                row[f"tokens_per_s_{s}"] = sp[k]["tokens"] / max(1e-9, sp[k]["time"])
            row["speedup_int8"] = row["tokens_per_s_int8"] / max(1e-9, row["tokens_per_s_fp32"])
            row["speed_texts_equal"] = sum(a == b for a, b in zip(sp[f]["texts"], sp[q]["texts"]))
        n = sum(len(v) for v in hits[f].values())
        if n:
            row["examples"] = n
            row["accuracy_fp32"] = 100.0 * sum(sum(v) for v in hits[f].values()) / n
            row["accuracy_int8"] = 100.0 * sum(sum(v) for v in hits[q].values()) / n
            row["diff"] = bootstrap_diff(hits[q], hits[f])
            same = sum(a == b for t in texts[f] for a, b in zip(texts[f][t], texts[q][t]))
            row["text_agreement"] = same / n
        rows[m] = row
    return rows


def markdown(res: dict) -> str:
    lines = [
        "# int8 members against fp32 (bundled pair, CPU)",
        "",
        f"Command: `{res['command']}`  ",
        f"Machine: {res['machine']}; torch threads {res['threads']}; torch {res['torch']}, torchao "
        f"{res['torchao']}, transformers {res['transformers']}. Whole run {res['minutes']:.1f} min"
        f"{' (stopped at the time limit)' if res['stopped_early'] else ''}.",
        "",
        f"Speed: {res['speed_prompts']} chat speed prompts x {res['tokens']} new tokens, greedy, int8 and fp32 "
        "engines interleaved prompt by prompt. Quality: the dev suite, raw 3-shot prompts, greedy, stop "
        '"\\n", exact match, examples round-robin over the 7 tasks.',
        "",
        "| method | tok/s fp32 | tok/s int8 | int8/fp32 | speed texts equal | examples | acc fp32 | acc int8 "
        "| int8 - fp32 (95% CI) | texts equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, r in res["methods"].items():
        d = r.get("diff")
        ci = f"{d['diff']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]" if d else "-"
        lines.append(
            f"| {m} | {r.get('tokens_per_s_fp32', 0):.2f} | {r.get('tokens_per_s_int8', 0):.2f} | "
            f"{r.get('speedup_int8', 0):.2f} | {r.get('speed_texts_equal', '-')}/{res['speed_prompts']} | "
            f"{r.get('examples', 0)} | {r.get('accuracy_fp32', 0):.1f}% | {r.get('accuracy_int8', 0):.1f}% | {ci} | "
            f"{100 * r.get('text_agreement', 0):.0f}% |"
        )
    lines += ["", f"Peak RSS of the whole process (both settings loaded): {res['peak_rss_mb']:.0f} MB.", ""]
    if res.get("verdict"):
        lines += ["## Should int8 be the CPU default?", "", res["verdict"], ""]
    return "\n".join(lines)


def rss(out: Path, tokens: int) -> None:
    """Peak RSS (loading included) and RSS after one speed prompt, per setting, each in a fresh
    process with the pair loaded (engine "unite")."""
    import subprocess
    import sys

    code = (
        "import resource, sys, torch; sys.path.insert(0, {here!r}); import quantized as q; "
        "torch.set_num_threads(1); e = q.engines_of(['unite'], {s!r}); "
        "e[('unite', {s!r})].generate('What is the capital of France?', max_new_tokens={n}); "
        "import gc; gc.collect(); "
        "now = [int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmRSS')][0]; "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, now / 1024)"
    )
    here = str(Path(__file__).parent)
    res = {}
    for s in SETTINGS:
        c = code.format(here=here, s=s, n=tokens)
        run = subprocess.run([sys.executable, "-c", c], capture_output=True, text=True, check=True)
        peak, now = map(float, run.stdout.strip().splitlines()[-1].split())
        res[s] = {"peak_rss_mb": round(peak), "rss_after_mb": round(now)}
        print(f"{s}: peak RSS {peak:.0f} MB, RSS after the prompt {now:.0f} MB", flush=True)
    (out / "rss.json").write_text(json.dumps({"settings": res, "what": rss.__doc__}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/quantized")
    ap.add_argument("--per-task", type=int, default=20)
    ap.add_argument("--speed-prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a shared machine)")
    ap.add_argument("--minutes", type=float, default=30.0, help="stop the quality rounds after this long")
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--rss", action="store_true", help="only the peak RSS of each setting, each in its own process")
    args = ap.parse_args()
    if args.rss:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        return rss(Path(args.out), args.tokens)

    import torch
    import torchao
    import transformers

    torch.set_num_threads(args.threads)
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engs = engines(args.methods)
    main_tok = engs[(args.methods[0], "fp32")].members[0].tokenizer
    tasks = load_tasks(args.per_task, main_tok)
    res = {
        "command": "python benchmarks/quantized.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items()
        ),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "threads": args.threads,
        "torch": torch.__version__,
        "torchao": torchao.__version__,
        "transformers": transformers.__version__,
        "speed_prompts": args.speed_prompts,
        "tokens": args.tokens,
        "stopped_early": False,
    }
    hits = {f"{m}/{s}": {} for m in args.methods for s in SETTINGS}
    texts = {f"{m}/{s}": {} for m in args.methods for s in SETTINGS}
    sp = speed(engs, args.methods, args.speed_prompts, args.tokens)

    def save(verdict=None):
        res["minutes"] = (time.time() - t0) / 60
        res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        res["methods"] = summarize(args.methods, sp, hits, texts)
        res["speed_texts"] = {k: v["texts"] for k, v in sp.items()}
        res["quality_texts"] = texts
        res["hits"] = hits
        if verdict:
            res["verdict"] = verdict
        (out / "results.json").write_text(json.dumps(res, indent=1))
        (out / "results.md").write_text(markdown(res))

    save()
    for i in range(args.per_task):
        if time.time() - t0 > 60 * args.minutes:
            res["stopped_early"] = True
            break
        quality_round(engs, args.methods, tasks, i, hits, texts)
        save()
        print(f"round {i + 1}/{args.per_task} done at {(time.time() - t0) / 60:.1f} min", flush=True)
    save()


if __name__ == "__main__":
    main()
