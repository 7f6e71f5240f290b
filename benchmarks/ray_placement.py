"""placement="ray" against placement="local": time per token and bytes moved, per method.

For each method, one engine with the members in this process and one with each member in a Ray
actor (a local Ray cluster, one CPU per member unless --cpus-per-member says otherwise) run the
same chat prompts, greedy, the same budget, alternating prompt by prompt so both see the same
machine. Reports per method: time per output token for both and their ratio, whether every text
is equal, the payload bytes that crossed to and from the actors per token, and where the time
goes (the members' forward seconds on each side, the rest, and the caller's waits for an actor's
answer per token). "safe+json" runs safe under a JSON Schema response_format: a grammar masks
whole rows, which are fetched from the actors. Writes results.json and results.md.

    python benchmarks/ray_placement.py --out benchmarks/results/ray
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

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


SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {
                "answer": {"type": "string", "maxLength": 60},
                "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
            },
            "required": ["answer", "confidence"],
        },
    },
}


def run(engine, prompt: str, max_tokens: int, response_format=None):
    t = time.perf_counter()
    res = engine.generate(prompt, max_new_tokens=max_tokens, response_format=response_format)
    wall = time.perf_counter() - t
    fwd = sum(m["forward_time_s"] for m in res.stats["members"].values())
    fwd_max = max(m["forward_time_s"] for m in res.stats["members"].values())
    return res, wall, fwd, fwd_max


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    ap.add_argument(
        "--methods",
        default="single,unite,safe,specfuse,smc,safe+json",
        help="comma-separated; METHOD+json answers under a JSON Schema response_format",
    )
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--smc-max-tokens", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--cpus-per-member", type=float, default=1.0)
    ap.add_argument("--out", default="ray-placement")
    args = ap.parse_args()
    import ray
    import torch

    from ensemble_llm import Ensemble

    models = args.models.split(",")
    ray.init(include_dashboard=False, log_to_driver=False)
    resources = {"num_cpus": args.cpus_per_member}
    rows = []
    for label in args.methods.split(","):
        method, constrained = label.split("+")[0], label.endswith("+json")
        fmt = SCHEMA if constrained else None
        budget = args.smc_max_tokens if method == "smc" else args.max_tokens
        local = Ensemble(models, method, progress=False).load()
        remote = Ensemble(models, method, progress=False, placement="ray", member_resources=resources).load()
        for e in (local, remote):  # warm-up: first forwards, calibration cache read
            e.generate("Hello", max_new_tokens=4)
        acc = {k: 0.0 for k in ("local_s", "ray_s", "local_fwd", "ray_fwd", "ray_fwd_max", "tokens", "bytes", "trips")}
        equal = 0
        for p in PROMPTS[: args.prompts]:
            a, ta, fa, _ = run(local, p, budget, fmt)
            b, tb, fb, fbm = run(remote, p, budget, fmt)
            equal += a.text == b.text
            acc["local_s"] += ta
            acc["ray_s"] += tb
            acc["local_fwd"] += fa
            acc["ray_fwd"] += fb
            acc["ray_fwd_max"] += fbm
            acc["tokens"] += a.run_stats.tokens_out
            acc["bytes"] += b.stats["bytes_moved"]
            acc["trips"] += sum(m["round_trips"] for m in b.stats["members"].values())
        n = max(1, acc["tokens"])
        row = {
            "method": label,
            "prompts": args.prompts,
            "max_tokens": budget,
            "tokens": int(acc["tokens"]),
            "texts_equal": f"{equal}/{args.prompts}",
            "local_s_per_token": acc["local_s"] / n,
            "ray_s_per_token": acc["ray_s"] / n,
            "ray_over_local": acc["ray_s"] / max(1e-9, acc["local_s"]),
            "bytes_moved_per_token": acc["bytes"] / n,
            "round_trips_per_token": acc["trips"] / n,
            "local_forward_s_per_token": acc["local_fwd"] / n,
            "ray_actor_forward_s_per_token": acc["ray_fwd"] / n,
            "local_other_s_per_token": (acc["local_s"] - acc["local_fwd"]) / n,
            "ray_other_s_per_token": (acc["ray_s"] - acc["ray_fwd"]) / n,
        }
        rows.append(row)
        print(json.dumps(row))
    results = {
        "models": models,
        "cpus_per_member": args.cpus_per_member,
        "torch": torch.__version__,
        "ray": ray.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "methods": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    md = [
        f"# placement='ray' against 'local': {', '.join(models)}\n",
        f"{args.prompts} chat prompts, greedy, up to {args.max_tokens} tokens ({args.smc_max_tokens} for smc); "
        f"a local Ray cluster on this machine ({os.cpu_count()} CPUs), {args.cpus_per_member:g} CPU per member actor "
        "(torch threads = its CPUs); the local engine uses every core.\n",
        "| method | texts equal | local s/token | ray s/token | ray / local | bytes moved / token "
        "| round trips / token | "
        "forward s/token local | forward s/token actors (sum) | other s/token local | other s/token ray |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['method']} | {r['texts_equal']} | {r['local_s_per_token']:.4f} | {r['ray_s_per_token']:.4f} | "
            f"{r['ray_over_local']:.2f} | {r['bytes_moved_per_token']:.0f} | {r['round_trips_per_token']:.1f} | "
            f"{r['local_forward_s_per_token']:.4f} | {r['ray_actor_forward_s_per_token']:.4f} | "
            f"{r['local_other_s_per_token']:.4f} | {r['ray_other_s_per_token']:.4f} |"
        )
    text = "\n".join(md) + "\n"
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
