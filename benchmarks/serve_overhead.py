"""Server overhead: time per token through `ensemble-llm serve` against the same engine in process.

Starts a real server process on 127.0.0.1 with the given members and method, then, on the same
prompts (greedy, the same budget): (1) in process, one request at a time; (2) one client through
the server (the `openai` client, streaming off); (3) 16 concurrent clients through the server.
Reports time per output token for (1) and (2) and their ratio, and the output-token throughput of
(3) against (1). Writes results.json and results.md.

    python benchmarks/serve_overhead.py --out benchmarks/results/serve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    "What is the capital of France?",
    "Name three colours.",
    "Why is the sky blue?",
    "Describe a cat.",
    "What is photosynthesis?",
    "Give two tips for sleeping well.",
    "What is a prime number?",
    "Write one sentence about the sea.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    ap.add_argument("--method", default="safe")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--out", default="serve-overhead")
    args = ap.parse_args()
    import openai
    from helpers import start_server

    from ensemble_llm import Ensemble

    models = args.models.split(",")
    engine = Ensemble(models, args.method).load()
    engine.generate("Hello", max_new_tokens=4)
    t, tokens = time.perf_counter(), 0
    for p in PROMPTS:
        tokens += engine.generate(p, max_new_tokens=args.max_tokens).usage.completion_tokens
    local_s, local_tokens = time.perf_counter() - t, tokens

    proc, base = start_server(models, args.method)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
        t, tokens = time.perf_counter(), 0
        for p in PROMPTS:
            res = client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": p}], max_tokens=args.max_tokens
            )
            tokens += res.usage.completion_tokens
        one_s, one_tokens = time.perf_counter() - t, tokens

        async def many():
            aclient = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
            reqs = [PROMPTS[i % len(PROMPTS)] for i in range(args.clients * 2)]
            sem = asyncio.Semaphore(args.clients)

            async def one(p):
                async with sem:
                    r = await aclient.chat.completions.create(
                        model="x", messages=[{"role": "user", "content": p}], max_tokens=args.max_tokens
                    )
                    return r.usage.completion_tokens

            t0 = time.perf_counter()
            counts = await asyncio.gather(*[one(p) for p in reqs])
            return time.perf_counter() - t0, sum(counts)

        many_s, many_tokens = asyncio.run(many())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    results = {
        "models": models,
        "method": args.method,
        "max_tokens": args.max_tokens,
        "prompts": len(PROMPTS),
        "in_process_s_per_token": local_s / max(1, local_tokens),
        "server_1_client_s_per_token": one_s / max(1, one_tokens),
        "server_over_in_process": (one_s / max(1, one_tokens)) / (local_s / max(1, local_tokens)),
        "in_process_tokens_per_s": local_tokens / local_s,
        "server_clients": args.clients,
        "server_many_tokens_per_s": many_tokens / many_s,
        "server_many_over_in_process_throughput": (many_tokens / many_s) / (local_tokens / local_s),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    md = (
        f"# Server overhead: {args.method} over {', '.join(models)}\n\n"
        f"{len(PROMPTS)} chat prompts, greedy, up to {args.max_tokens} tokens each.\n\n"
        "| | s/token | tokens/s |\n|---|---|---|\n"
        f"| in process, one request at a time | {results['in_process_s_per_token']:.4f} | "
        f"{results['in_process_tokens_per_s']:.1f} |\n"
        f"| through the server, 1 client | {results['server_1_client_s_per_token']:.4f} | |\n"
        f"| through the server, {args.clients} concurrent clients | | {results['server_many_tokens_per_s']:.1f} |\n\n"
        f"1-client ratio (server / in process, per token): {results['server_over_in_process']:.3f}. "
        f"{args.clients}-client throughput over in-process sequential: "
        f"{results['server_many_over_in_process_throughput']:.2f}x (one engine decodes one request at a time, "
        "so concurrency adds no throughput; it must not lose any).\n"
    )
    (out / "results.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
