"""Continuous batching: aggregate throughput and latency at 1, 2, 4, 8 concurrent clients, per method.

For each method, one engine (max_batch = the most clients) on the bundled pair. Each level runs
the same requests (PROMPTS, greedy, chat, up to --max-tokens), N client threads taking the next
request as they finish one, in process (`Ensemble.generate` from N threads) or, with --server,
through a real `ensemble-llm serve` process and the `openai` client. It reports aggregate output
tokens/s (the main member's tokens), its ratio to 1 client, p50/p95 request latency, and how many
texts differ from the 1-client run (greedy: each difference is listed with the first differing
character). Writes results.json and results.md.

    python benchmarks/batching_throughput.py --out benchmarks/results/batching
    python benchmarks/batching_throughput.py --ray --out benchmarks/results/batching_ray
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from serve_overhead import PROMPTS  # noqa: E402 (the same 8 chat prompts as the serve-overhead bench)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_level(ask, prompts: list[str], clients: int) -> dict:
    """The prompts through `clients` threads: texts, tokens, wall time, latencies."""

    def one(p):
        t = time.perf_counter()
        text, tokens = ask(p)
        return text, tokens, time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        out = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    tokens = sum(o[1] for o in out)
    lat = [o[2] for o in out]
    return {
        "clients": clients,
        "wall_s": round(wall, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2),
        "latency_p50_s": round(statistics.median(lat), 2),
        "latency_p95_s": round(percentile(lat, 0.95), 2),
        "texts": [o[0] for o in out],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    ap.add_argument("--methods", default="single,unite,safe,specfuse,smc")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=None, help="the engine's max_batch (default: the most clients)")
    ap.add_argument("--repeat", type=int, default=1, help="send the prompts this many times (e.g. 8: 64 requests)")
    ap.add_argument("--server", action="store_true", help="through a real `ensemble-llm serve` process")
    ap.add_argument("--ray", action="store_true", help="placement='ray': each member in an actor of a local cluster")
    ap.add_argument("--no-head-pad", action="store_true", help="in process: undo every layer's plan (headpad.py)")
    ap.add_argument("--no-prefix-cache", action="store_true", help="in process: no prompt prefix reuse (prefix.py)")
    ap.add_argument(
        "--whole-steps",
        action="store_true",
        help="in process: a step is one forward over every row, output layer on all (split_columns, sparse_head off)",
    )
    ap.add_argument("--out", default="batching")
    args = ap.parse_args()
    from ensemble_llm import Ensemble

    models, levels = args.models.split(","), [int(c) for c in args.clients.split(",")]
    prompts, max_batch = PROMPTS * args.repeat, args.max_batch or max(levels)
    rows = []
    for method in args.methods.split(","):
        members = models[:1] if method == "single" else models
        cfg = {"n_particles": 4} if method == "smc" else None
        proc = None
        if args.server:
            import openai
            from helpers import start_server

            proc, base = start_server(members, method, extra=["--max-batch", str(max_batch)])
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)

            def ask(p, client=client):
                r = client.chat.completions.create(
                    model="ensemble",
                    messages=[{"role": "user", "content": p}],
                    max_tokens=args.max_tokens,
                    temperature=0,
                )
                return r.choices[0].message.content, r.usage.completion_tokens
        else:
            place = {}
            if args.ray:  # one CPU per member actor (this machine has 2)
                place = {"placement": "ray", "member_resources": {"num_cpus": 2 / len(members)}}
            engine = Ensemble(members, method, cfg, max_batch=max_batch, **place).load()
            if args.no_head_pad and not args.ray:
                from ensemble_llm.members.backends.transformers.headpad import pad_rows

                for m in engine.members:
                    pad_rows(m.model, None)
            if args.whole_steps and not args.ray:
                from ensemble_llm.members.steps import BatchingConfig

                engine.scheduler.config = BatchingConfig(sparse_head=False, split_columns=10**9)
            for m in engine.members if args.no_prefix_cache and not args.ray else ():
                m.prefixes.max_bytes = 0
                m.prefixes.clear()

            def ask(p, engine=engine):
                r = engine.generate(p, max_new_tokens=args.max_tokens)
                return r.text, r.usage.completion_tokens

        try:
            ask("Hello")  # warm up
            base_level = None
            for c in levels:
                res = run_level(ask, prompts, c)
                base_level = base_level or res
                diff = [
                    {"prompt": p, "alone": a, "together": b}
                    for p, a, b in zip(prompts, base_level["texts"], res["texts"])
                    if a != b
                ]
                res.update(
                    method=method,
                    speedup=round(res["tokens_per_s"] / base_level["tokens_per_s"], 2),
                    p50_ratio=round(res["latency_p50_s"] / base_level["latency_p50_s"], 2),
                    texts_differing=len(diff),
                    differences=diff,
                )
                print(json.dumps({k: v for k, v in res.items() if k not in ("texts", "differences")}), flush=True)
                rows.append(res)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
            if args.ray:  # the next method's actors need the CPUs
                from ensemble_llm.ray import clear_actors

                clear_actors()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    where = "through `ensemble-llm serve` (openai client)" if args.server else "in process"
    if args.ray:
        where += ", members in Ray actors (local cluster, 2 CPUs shared by the actors)"
    lines = [
        f"# Continuous batching: {len(prompts)} chat requests, greedy, up to {args.max_tokens} tokens, {where}",
        "",
        f"Members: {args.models} (single: the first). 2 CPU cores. `python benchmarks/batching_throughput.py"
        + (" --server" if args.server else "")
        + (" --ray" if args.ray else "")
        + (" --no-head-pad" if args.no_head_pad else "")
        + (" --no-prefix-cache" if args.no_prefix_cache else "")
        + (" --whole-steps" if args.whole_steps else "")
        + f" --methods {args.methods} --clients {args.clients} --max-tokens {args.max_tokens}"
        + f" --repeat {args.repeat} --max-batch {max_batch}`.",
        "",
        "| method | clients | tokens/s | x 1 client | p50 s | p95 s | p50 x 1 client | texts differing |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['clients']} | {r['tokens_per_s']} | {r['speedup']} | {r['latency_p50_s']} "
            f"| {r['latency_p95_s']} | {r['p50_ratio']} | {r['texts_differing']} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
