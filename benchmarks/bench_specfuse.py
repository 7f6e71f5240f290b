"""SpecFuse benchmark: time of `specfuse` against the sum of the members' `single` times, time to
first streamed chunk, rounds won per member, and accuracy next to each member alone.

    python benchmarks/bench_specfuse.py [--prompts 20] [--max-new-tokens 128] [--qa 200] [--out benchmarks/results]

All engines run in one process on the same prompts, interleaved per prompt, greedy. On one CPU the
members' drafts take turns, so the natural bound is the sum of the members' single-model times
for the same output length: the ratio compares time per output token (first member's tokens)
of specfuse with the sum of each member's own time per output token. Writes specfuse.json and
specfuse.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).parent))

from bench_safe import DATA, PROMPTS, norm  # noqa: E402

from ensemble_llm import DEFAULT_MODELS, Ensemble  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--qa", type=int, default=200)
    ap.add_argument("--segment-len", type=int, default=10)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    pair = list(DEFAULT_MODELS)
    engines = {
        "specfuse": Ensemble(pair, method="specfuse", config={"segment_len": args.segment_len}),
        "single-0": Ensemble(pair, method="single", config={"member": 0}),
        "single-1": Ensemble(pair, method="single", config={"member": 1}),
    }
    for e in engines.values():
        e.load()
        e.generate("Hello, who are you?", max_new_tokens=8)  # warm-up, outside the timings
    names = [m.name for m in engines["specfuse"].members]
    speed = {k: {"time": 0.0, "tokens": 0, "ttfc": []} for k in engines}
    wins = dict.fromkeys(names, 0)
    rounds = 0
    weights = []
    for p in PROMPTS[: args.prompts]:
        for key, eng in engines.items():  # interleaved: machine noise hits all alike
            r = eng.generate(p, max_new_tokens=args.max_new_tokens)
            s = speed[key]
            s["time"] += r.stats["time_s"]
            s["tokens"] += r.stats["tokens_out"]
            s["ttfc"].append(r.stats["time_to_first_chunk_s"] or r.stats["time_s"])
            if key == "specfuse":
                rounds += r.stats["rounds"]
                for n, w in r.stats["wins"].items():
                    wins[n] += w
                weights.append(r.stats["weights"])
    per_tok = {k: v["time"] / max(1, v["tokens"]) for k, v in speed.items()}
    bound = per_tok["single-0"] + per_tok["single-1"]

    lines = [json.loads(x) for x in DATA.read_text().splitlines()[: 3 + args.qa]]
    shots = "".join(f"Q: {x['input']}\nA: {x['targets'][0]}\n" for x in lines[:3])
    acc = dict.fromkeys(engines, 0)
    for ex in lines[3:]:
        prompt = shots + f"Q: {ex['input']}\nA:"
        for key, eng in engines.items():
            out = eng.generate(prompt, max_new_tokens=12, raw=True, stop=["\n"]).text
            acc[key] += norm(out) in {norm(t) for t in ex["targets"]}
    n_qa = len(lines) - 3
    result = {
        "models": pair, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
        "segment_len": args.segment_len, "device": str(engines["specfuse"].members[0].device),
        "time_per_token_s": per_tok,
        "ratio_specfuse_over_sum_of_singles": per_tok["specfuse"] / bound,
        "time_to_first_chunk_s": {k: statistics.median(v["ttfc"]) for k, v in speed.items()},
        "rounds": rounds, "rounds_won": {n: w / max(1, rounds) for n, w in wins.items()},
        "final_weights_mean": {n: statistics.mean(w[n] for w in weights) for n in names},
        "qa_wikidata": {"examples": n_qa, "accuracy": {k: v / n_qa for k, v in acc.items()}},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "specfuse.json").write_text(json.dumps(result, indent=2))
    label = {"specfuse": "specfuse", "single-0": f"single ({names[0]})", "single-1": f"single ({names[1]})"}
    md = [f"# SpecFuse benchmark ({args.prompts} prompts x {args.max_new_tokens} new tokens, greedy, "
          f"segment_len {args.segment_len}, {result['device']})", "",
          "| method | s/token | median TTFC s | qa_wikidata acc |", "|---|---|---|---|"]
    for k in engines:
        md.append(f"| {label[k]} | {per_tok[k]:.4f} | {result['time_to_first_chunk_s'][k]:.2f} | {acc[k] / n_qa:.1%} |")
    md += ["", f"specfuse / (sum of the members' single s/token) = **{result['ratio_specfuse_over_sum_of_singles']:.2f}** "
           f"(target <= 1.2).",
           "Rounds won: " + ", ".join(f"{n} {f:.0%}" for n, f in result["rounds_won"].items())
           + f" ({rounds} rounds). Mean final Hedge weights: "
           + ", ".join(f"{n} {w:.2f}" for n, w in result["final_weights_mean"].items()) + ".",
           "", f"qa_wikidata: first {n_qa} examples after 3 shots, exact match (case-insensitive, trailing "
           "period ignored)."]
    (out / "specfuse.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
