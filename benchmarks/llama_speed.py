"""Members on llama.cpp against what a user would run instead, side by side in one run.

1. One model: llama-cpp-python's own `Llama.__call__` against `Ensemble(method="single")` on
   llama.cpp and on transformers, the same GGUF and the same prompt tokens, greedy.
2. Every method on the bundled pair, on llama.cpp and on transformers (tokens/s, and each method's
   time per token over its main member alone on the same backend).
3. Eight clients against one after another, on llama.cpp and on transformers: tokens/s, the
   ratio, the texts that differ; and the engine's own ceiling, llama.cpp's batched one-token
   decode of 8 sequences over 1 (the low-level API, no ensemble), for each member.

Each section (one model, a ceiling, the methods or the clients on one backend) runs in a fresh
process: an engine that ran before must not slow the next one (`benchmarks/second_engine.py`
measures that llama.cpp engines in one process do not, which is why the engines of one section
share theirs). Writes results.json and results.md into --out.

    python benchmarks/llama_speed.py --out benchmarks/results/llama_speed
    python benchmarks/llama_speed.py --backends llama.cpp --out ...   # without the transformers runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from batching_throughput import run_level  # noqa: E402
from serve_overhead import PROMPTS  # noqa: E402

PAIR = ("smollm2-135m-instruct", "gemma-3-270m")
SPEED = ["Explain why the sky is blue.", "Write a short poem about autumn.", "Give three tips for staying healthy."]
METHODS = ("single", "unite", "safe", "specfuse", "smc")


def members(names, backend: str) -> list:
    return [{"model": n, "backend": backend} for n in names]


def one_model(name: str, tokens: int, backends: tuple[str, ...]) -> dict:
    """Llama.__call__ against single on llama.cpp (and on transformers), the same prompt ids."""
    import llama_cpp

    from ensemble_llm import Ensemble
    from ensemble_llm.chat import render_chat
    from ensemble_llm.members.backends.llama_cpp.member import cpu_cores
    from ensemble_llm.members.loader import gguf_file, resolve_source

    engines = {b: Ensemble(members([name], b), "single", progress=False).load() for b in backends}
    m = engines["llama.cpp"].members[0]
    texts = [render_chat(m, [{"role": "user", "content": p}]) if m.has_chat_template else p for p in SPEED]
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(str(gguf_file(resolve_source(name))), n_ctx=2048, n_threads=cpu_cores(), verbose=False)
    load = time.perf_counter() - t0
    runs = {"llama_cpp_Llama": lambda t: _llama_call(llm, m.prompt_ids(t), tokens)}
    for b, eng in engines.items():
        runs[f"single_{b}"] = lambda t, eng=eng: _ours(eng, t, tokens)
    for run in runs.values():
        run(texts[0])  # warm
    out = {k: {"tokens": 0, "seconds": 0.0} for k in runs}
    for t in texts:  # interleaved, prompt by prompt
        for k, run in runs.items():
            n, s = run(t)
            out[k]["tokens"] += n
            out[k]["seconds"] += s
    for v in out.values():
        v["tokens_per_s"] = round(v["tokens"] / v["seconds"], 2)
    base = out["llama_cpp_Llama"]["tokens_per_s"]
    res = {
        "member": name,
        "llama_load_s": round(load, 2),
        "runs": out,
        "ours_over_llama": round(out["single_llama.cpp"]["tokens_per_s"] / base, 3),
    }
    if "transformers" in backends:
        hf = out["single_transformers"]["tokens_per_s"]
        res["llama_over_transformers"] = round(out["single_llama.cpp"]["tokens_per_s"] / hf, 2)
    return res


def _llama_call(llm, ids: list[int], tokens: int) -> tuple[int, float]:
    llm.reset()
    t0 = time.perf_counter()
    out = llm(ids, max_tokens=tokens, temperature=0.0, top_k=1)
    return out["usage"]["completion_tokens"], time.perf_counter() - t0


def _ours(eng, text: str, tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = eng.generate(text, max_new_tokens=tokens, raw=True)
    return r.usage.completion_tokens, time.perf_counter() - t0


def every_method(tokens: int, b: str) -> dict:
    """Each method on the pair on one backend: tokens/s, and time per token over the main member alone."""
    from ensemble_llm import Ensemble

    engines = {"single-0": Ensemble(members(PAIR, b), "single", {"member": 0}, progress=False)}
    engines["single-1"] = Ensemble(members(PAIR, b), "single", {"member": 1}, progress=False)
    for meth in METHODS[1:]:
        engines[meth] = Ensemble(members(PAIR, b), meth, {"n_particles": 4} if meth == "smc" else None, progress=False)
    rows = {k: {"tokens": 0, "seconds": 0.0} for k in engines}
    for eng in engines.values():
        eng.generate(SPEED[0], max_new_tokens=4)  # load, calibrate, warm
    for p in SPEED:
        for k, eng in engines.items():
            t0 = time.perf_counter()
            r = eng.generate(p, max_new_tokens=tokens)
            rows[k]["seconds"] += time.perf_counter() - t0
            rows[k]["tokens"] += r.usage.completion_tokens
            rows[k]["main"] = r.stats.get("main_member", eng.members[eng._method.main_member() or 0].name)
    for v in rows.values():
        v["tokens_per_s"] = round(v["tokens"] / v["seconds"], 2)
        alone = rows["single-0" if v["main"] == PAIR[0] else "single-1"]
        v["x_main_alone_time_per_token"] = round(alone["tokens_per_s"] / v["tokens_per_s"], 2)
    return rows


def ceiling(name: str, n_seq: int = 8, steps: int = 32) -> dict:
    """llama.cpp's own batched one-token decode of n sequences over 1 (tokens/s), low-level API."""
    import torch

    from ensemble_llm.members.backends.llama_cpp.member import LlamaMember
    from ensemble_llm.members.loader import gguf_file, gguf_tokenizer, resolve_source
    from ensemble_llm.members.plan import gguf_params_and_config, kv_bytes_per_token

    src = resolve_source(name)
    path = gguf_file(src)
    _, cfg = gguf_params_and_config(path)
    m = LlamaMember(
        name,
        str(path),
        gguf_tokenizer(src, path),
        n_ctx=4096,
        kv_per_token=kv_bytes_per_token(cfg, torch.float16),
        device=torch.device("cpu"),
    )
    run = m.runner
    rates = {}
    for n in (1, n_seq):
        seqs = [run.seqs.take() for _ in range(n)]
        prompt = m.prompt_ids("Tell me a story.")
        for s in seqs:
            run.decode(prompt, list(range(len(prompt))), [s.id] * len(prompt), [False] * len(prompt))
        t0 = time.perf_counter()
        for k in range(steps):
            run.decode([100 + k] * n, [len(prompt) + k] * n, [s.id for s in seqs], [True] * n)
        rates[n] = n * steps / (time.perf_counter() - t0)
        del seqs
    return {
        "member": name,
        "tokens_per_s_1": round(rates[1], 1),
        f"tokens_per_s_{n_seq}": round(rates[n_seq], 1),
        "ceiling": round(rates[n_seq] / rates[1], 2),
    }


def clients(tokens: int, n: int, b: str) -> dict:
    """n clients against one after another, on one backend, every method."""
    from ensemble_llm import Ensemble

    out = {}
    for meth in METHODS:
        mem = members(PAIR[:1] if meth == "single" else PAIR, b)
        eng = Ensemble(mem, meth, {"n_particles": 4} if meth == "smc" else None, max_batch=n, progress=False).load()

        def ask(p, eng=eng):
            r = eng.generate(p, max_new_tokens=tokens)
            return r.text, r.usage.completion_tokens

        ask("Hello")
        one, many = run_level(ask, PROMPTS, 1), run_level(ask, PROMPTS, n)
        out[f"{meth}:{b}"] = {
            "tokens_per_s_1": one["tokens_per_s"],
            f"tokens_per_s_{n}": many["tokens_per_s"],
            "ratio": round(many["tokens_per_s"] / one["tokens_per_s"], 2),
            "texts_differing": sum(a != c for a, c in zip(one["texts"], many["texts"])),
            "requests": len(PROMPTS),
        }
        print(meth, b, out[f"{meth}:{b}"], file=sys.stderr, flush=True)
        eng.close()
    return out


def section(name: str, args) -> object:
    """One section of the bench, run in this (fresh) process."""
    kind, _, arg = name.partition(":")
    if kind == "one_model":
        return one_model(arg, args.tokens, tuple(args.backends.split(",")))
    if kind == "ceiling":
        return ceiling(arg, args.clients)
    if kind == "methods":
        return every_method(args.tokens, arg)
    return clients(args.client_tokens, args.clients, arg)


def in_fresh_process(name: str, args) -> object:
    cmd = [sys.executable, __file__, "--section", name, "--out", args.out, "--tokens", str(args.tokens)]
    cmd += ["--client-tokens", str(args.client_tokens), "--clients", str(args.clients), "--backends", args.backends]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--client-tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--backends", default="llama.cpp,transformers")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # internal: one section, in this process
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.section:
        print(json.dumps(section(args.section, args)))
        return
    backends = args.backends.split(",")
    res = {"args": vars(args), "threads": os.cpu_count()}
    res["one_model"] = [in_fresh_process(f"one_model:{n}", args) for n in PAIR]
    print(json.dumps(res["one_model"], indent=1), flush=True)
    res["ceiling"] = [in_fresh_process(f"ceiling:{n}", args) for n in PAIR]
    res["methods"] = {b: in_fresh_process(f"methods:{b}", args) for b in backends}
    if "transformers" in backends:
        for k, v in res["methods"]["llama.cpp"].items():
            v["x_transformers"] = round(v["tokens_per_s"] / res["methods"]["transformers"][k]["tokens_per_s"], 2)
    print(json.dumps(res["methods"], indent=1), flush=True)
    res["clients"] = {k: v for b in backends for k, v in in_fresh_process(f"clients:{b}", args).items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(report(res))


def report(res: dict) -> str:
    a = res["args"]
    lines = [
        f"# Members on llama.cpp, side by side (`python benchmarks/llama_speed.py --backends {a['backends']}`, "
        f"{res['threads']} cores; each section a fresh process)",
        "",
        f"## One model: {a['tokens']} tokens, greedy, the same prompt ids",
        "",
        "| member | Llama.__call__ tok/s | single on llama.cpp | single on transformers | ours / Llama "
        "| llama.cpp / transformers |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["one_model"]:
        runs = r["runs"]
        hf = runs.get("single_transformers", {}).get("tokens_per_s", "-")
        lines.append(
            f"| {r['member']} | {runs['llama_cpp_Llama']['tokens_per_s']} | {runs['single_llama.cpp']['tokens_per_s']} "
            f"| {hf} | {r['ours_over_llama']} | {r.get('llama_over_transformers', '-')} |"
        )
    lines += [
        "",
        "## Every method on the pair",
        "",
        "| method | llama.cpp tok/s | transformers tok/s | llama.cpp / transformers | x main alone (llama.cpp) |",
        "|---|---|---|---|---|",
    ]
    for k, v in res["methods"]["llama.cpp"].items():
        t = res["methods"].get("transformers", {}).get(k, {}).get("tokens_per_s", "-")
        lines.append(
            f"| {k} | {v['tokens_per_s']} | {t} | {v.get('x_transformers', '-')} | {v['x_main_alone_time_per_token']} |"
        )
    n = a["clients"]
    lines += [
        "",
        f"## {n} clients against one after another ({a['client_tokens']} tokens)",
        "",
        "llama.cpp's own ceiling (batched one-token decode, low-level API): "
        + ", ".join(f"{c['member']} {c['ceiling']}x" for c in res["ceiling"]),
        "",
        f"| method | backend | tok/s 1 client | tok/s {n} clients | ratio | texts differing |",
        "|---|---|---|---|---|---|",
    ]
    for k, v in res["clients"].items():
        meth, b = k.split(":")
        lines.append(
            f"| {meth} | {b} | {v['tokens_per_s_1']} | {v[f'tokens_per_s_{n}']} | {v['ratio']} | "
            f"{v['texts_differing']}/{v['requests']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
