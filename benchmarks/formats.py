"""Run and report the formats set (issue 71; the set: formats_set.py, results/formats_set/set.json).

`run` scores one configuration (a member alone or a method over the bundled pair) on one half of
the set, in a fresh process, appending each reply to `<out>/<half>/<config>.jsonl` as it goes
(a rerun skips the replies already there). Few-shot prompts are raw text (16 tokens, stop at a
newline); chat prompts and shots as chat turns go through the members' chat templates (48 and 24
tokens); RAG questions go through LlamaIndex's query engine (`SummaryIndex` over the item's three
documents, the default text-QA prompt, `EnsembleLLM` over the same engine, 32 tokens).

`report` writes `<out>/<half>/report.json` and `report.md`: per format, every configuration pooled
against the better member and the per-task router (the better member on each task) with
paired-bootstrap 95% intervals, and per task against that task's better member.

    python benchmarks/formats.py run --config single-0 --half tune --out benchmarks/results/formats
    python benchmarks/formats.py run --config specfuse --half tune --formats qa arrow --out ...
    python benchmarks/formats.py report --half tune --out benchmarks/results/formats
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from formats_set import FORMATS, prompt, right  # noqa: E402

SET = Path(__file__).parent / "results" / "formats_set" / "set.json"
PAIR = ["smollm2-135m-instruct", "gemma-3-270m"]
CONFIGS = {
    "single-0": ([PAIR[0]], None, None),
    "single-1": ([PAIR[1]], None, None),
    "auto": (PAIR, "auto", None),  # the default: specfuse for raw prompts, safe for chat
    "specfuse": (PAIR, "specfuse", None),
    "unite": (PAIR, "unite", None),
    "safe": (PAIR, "safe", None),
}
TOKENS = {"qa": 16, "arrow": 16, "nextline": 16, "turns": 24, "chat": 48, "rag": 32}


def _done(path: Path) -> set[str]:
    if not path.exists():
        return set()
    return {json.loads(x)["key"] for x in path.read_text(encoding="utf-8").splitlines() if x.strip()}


def _ask(engine, item: dict, fmt: str, rag_llm) -> str:
    if fmt == "rag":
        from llama_index.core import Document, SummaryIndex

        index = SummaryIndex.from_documents([Document(text=t) for t in item["documents"]])
        return str(index.as_query_engine(llm=rag_llm).query(item["input"]))
    p = prompt(item, fmt)
    if isinstance(p, str):
        return engine.generate(p, max_new_tokens=TOKENS[fmt], raw=True, stop=["\n"]).text
    return engine.generate(p, max_new_tokens=TOKENS[fmt]).text


def run(args: argparse.Namespace) -> None:
    from ensemble_llm import Ensemble

    data = json.loads(SET.read_text(encoding="utf-8"))
    members, method, config = CONFIGS[args.config]
    if args.set:
        config = dict(config or {}) | {k: json.loads(v) for k, v in (x.split("=", 1) for x in args.set)}
    out = args.out / args.half / f"{args.label or args.config}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _done(out)
    jobs = [(f, it) for f in args.formats if f != "rag" for it in data[args.half]]
    jobs += [("rag", it) for it in data[f"rag_{args.half}"]] if "rag" in args.formats else []
    jobs = [(f, it) for f, it in jobs if f"{f}:{it['task']}:{it['input']}" not in done]
    if not jobs:
        return
    with Ensemble(members, method, config) as engine, out.open("a", encoding="utf-8") as fh:
        rag_llm = None
        if "rag" in args.formats:
            from llama_index.llms.ensemble_llm import EnsembleLLM

            rag_llm = EnsembleLLM(engine=engine, max_new_tokens=TOKENS["rag"])
        for fmt, item in jobs:
            t0 = time.perf_counter()
            reply = _ask(engine, item, fmt, rag_llm)
            row = {"key": f"{fmt}:{item['task']}:{item['input']}", "format": fmt, "task": item["task"]}
            row |= {"reply": reply, "right": right(reply, item, fmt), "s": round(time.perf_counter() - t0, 3)}
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            fh.flush()


def hits_of(folder: Path) -> dict[str, dict[str, dict[str, list[int]]]]:
    """{format: {task: {config: [0/1 per item]}}}: per format, the configurations that ran it, over
    the items every one of them answered."""
    rows = {}
    for path in sorted(folder.glob("*.jsonl")):
        lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
        rows[path.stem] = {r["key"]: r for r in lines}
    out: dict = {}
    for fmt in sorted({k.split(":")[0] for r in rows.values() for k in r}):
        ran = {cfg: {k for k in r if k.split(":")[0] == fmt} for cfg, r in rows.items()}
        ran = {cfg: keys for cfg, keys in ran.items() if keys}
        for key in sorted(set.intersection(*ran.values())):
            task = key.split(":")[1]
            for cfg in ran:
                out.setdefault(fmt, {}).setdefault(task, {}).setdefault(cfg, []).append(int(rows[cfg][key]["right"]))
    return out


def report_format(hits: dict[str, dict[str, list[int]]]) -> dict:
    """One format: pooled figures with intervals against the better member and the router, and
    per task against its better member."""
    from ensemble_llm.bench import bootstrap_diff

    tasks = sorted(hits)
    configs = list(hits[tasks[0]])
    singles = [c for c in configs if c.startswith("single-")]
    total = {c: sum(sum(hits[t][c]) for t in tasks) for c in configs}
    best = max(singles, key=lambda c: (total[c], c))
    better = {t: max(singles, key=lambda c: (sum(hits[t][c]), c)) for t in tasks}
    router = {t: hits[t][better[t]] for t in tasks}
    rep = {"examples": sum(len(hits[t][best]) for t in tasks), "best_member": best, "correct": total}
    rep["router"] = sum(sum(v) for v in router.values())
    # the most that picking one member's reply per item could reach: the headroom any selection has
    rep["either"] = sum(max(col) for t in tasks for col in zip(*(hits[t][c] for c in singles)))
    rep["methods"] = {}
    for c in configs:
        if c in singles:
            continue
        mine = {t: hits[t][c] for t in tasks}
        rep["methods"][c] = {
            "vs_best_member": bootstrap_diff(mine, {t: hits[t][best] for t in tasks}),
            "vs_router": bootstrap_diff(mine, router),
            "per_task": {
                t: {"correct": sum(mine[t]), "better_member": sum(router[t]), "n": len(mine[t])} for t in tasks
            },
        }
    return rep


def _ci(d: dict) -> str:
    return f"{d['diff']:+.1f} ({d['low']:+.1f} to {d['high']:+.1f})"


def markdown(reps: dict, half: str) -> str:
    md = [f"# Formats set, {half} half\n", "Points; paired-bootstrap 95% intervals.\n"]
    for fmt, rep in reps.items():
        singles = " / ".join(f"{c} {v}" for c, v in rep["correct"].items() if c.startswith("single-"))
        either = f"; either member right {rep['either']}" if "either" in rep else ""
        md.append(f"## {fmt} ({rep['examples']} items)\n\nmembers: {singles}; router {rep['router']}{either}\n")
        md.append("| method | correct | vs better member | vs router | tasks >2 points below their better member |")
        md.append("|---|---|---|---|---|")
        for c, m in rep["methods"].items():
            low = [t for t, x in m["per_task"].items() if (x["better_member"] - x["correct"]) * 100 / x["n"] > 2]
            cells = [c, str(rep["correct"][c]), _ci(m["vs_best_member"]), _ci(m["vs_router"]), ", ".join(low) or "-"]
            md.append("| " + " | ".join(cells) + " |")
        md.append("")
    return "\n".join(md)


def report(args: argparse.Namespace) -> None:
    folder = args.out / args.half
    hits = hits_of(folder)
    reps = {fmt: report_format(hits[fmt]) for fmt in [*FORMATS, "rag"] if fmt in hits}
    (folder / "report.json").write_text(json.dumps(reps, indent=1) + "\n", encoding="utf-8")
    (folder / "report.md").write_text(markdown(reps, args.half), encoding="utf-8")
    print(markdown(reps, args.half))


NAMES = {
    "single-0": "SmolLM2-135M alone",
    "single-1": "Gemma-3-270M alone",
    "router": "better member per task",
    "auto": "auto (the default)",
}


def plot(args: argparse.Namespace) -> None:
    """`<out>/<half>/accuracy.png`: each format's accuracy per configuration, the axis from 0."""
    from math import nan

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = json.loads((args.out / args.half / "report.json").read_text(encoding="utf-8"))
    fmts = list(reps)
    methods = [c for r in reps.values() for c in r["methods"]]
    configs = ["single-0", "single-1", "router"] + sorted(set(methods), key=methods.index)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.8 / len(configs)
    for j, c in enumerate(configs):
        # a configuration that did not run a format has no bar there
        acc = [
            100 * (r["router"] if c == "router" else r["correct"].get(c, nan)) / r["examples"] for r in reps.values()
        ]
        ax.bar([i + j * width for i in range(len(fmts))], acc, width, label=NAMES.get(c, c))
    labels = [f"{f}\n({reps[f]['examples']})" for f in fmts]
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(fmts))], labels)
    ax.set_ylim(0, 100)
    ax.set_ylabel("right answers, %")
    ax.set_title(f"The formats set, {args.half} half: the bundled pair on llama.cpp, greedy")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(args.out / args.half / "accuracy.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["run", "report", "plot"])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="specfuse")
    ap.add_argument("--half", choices=["tune", "outside"], default="tune")
    ap.add_argument("--formats", nargs="+", choices=[*FORMATS, "rag"], default=[*FORMATS, "rag"])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "formats")
    ap.add_argument("--set", nargs="*", default=[], help="method config fields, KEY=JSON (weights=[0.7,0.3])")
    ap.add_argument("--label", help="the configuration's name in the results (default: --config)")
    args = ap.parse_args()
    {"run": run, "report": report, "plot": plot}[args.command](args)


if __name__ == "__main__":
    main()
