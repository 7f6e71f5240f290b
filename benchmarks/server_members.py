"""Members on a llama.cpp server against members in process: same texts, and what a server costs.

    python benchmarks/server_members.py benchmarks/results/server_members/results.json

One llama-server over the bundled SmolLM2 GGUF (members/backends/server/build.py; --parallel 8, on loopback)
serves every part; each configuration runs in a fresh process.
- identity: greedy texts of 40 prompts (28 qa_wikidata few-shot prompts, raw, stop "\\n", 12 tokens;
  12 chat prompts, 32 tokens), SmolLM2 on the server + Gemma in process against both in process,
  for every method the server allows (single: SmolLM2 alone);
- one client: tokens/s of `single` through the server member against the server's own /completion
  (the same prompts as token ids, the same number of tokens, greedy);
- eight clients: tokens/s of `single` through the server member, 8 threads at once against 1, and
  the server's own /completion with 8 at once (its ceiling on this machine), asked as a user would
  (every token in one request) and as the member asks for greedy `single` (`LOOKAHEAD` tokens a
  request, no log-probs, the tokens so far sent back as the next prompt).

`--speed` reruns the speed rounds alone, into the results already there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from ensemble_llm import Ensemble
from ensemble_llm.bench import bundled_task, load_task
from ensemble_llm.members.backends.server import build
from ensemble_llm.members.backends.server.member import LOOKAHEAD
from ensemble_llm.members.fetch import fetch_bundled
from ensemble_llm.members.registry import BUNDLED

SMOL, GEMMA = "smollm2-135m-instruct", "gemma-3-270m"
METHODS = ("single", "specfuse", "safe", "unite")
CHAT = [
    "What is the capital of France?",
    "Name three rivers in Europe.",
    "Write a haiku about the sea.",
    "Describe a cat to a child.",
    "What is 12 + 7?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "What colour is the sky on a clear day?",
    "Translate 'good morning' into French.",
    "List two primary colours.",
    "What is the opposite of cold?",
    "Name a planet in the solar system.",
]
SPEED_PROMPTS = ["Tell me a story about a dragon.", "Explain how rain forms.", "Describe your favourite city."]
SPEED_TOKENS = 96


def requests() -> list[tuple[str, dict]]:
    shots, examples = load_task(bundled_task("qa_wikidata"), 28)
    raw = [
        (shots + "Q: " + ex["input"].strip() + "\nA:", {"raw": True, "max_new_tokens": 12, "stop": ["\n"]})
        for ex in examples
    ]
    return raw + [(c, {"max_new_tokens": 32}) for c in CHAT]


def members(where: str, method: str, url: str) -> list:
    smol = {"model": SMOL, "backend": "server", "url": url} if where == "server" else SMOL
    return [smol] if method == "single" else [smol, GEMMA]


def identity(where: str, method: str, url: str) -> dict:
    eng = Ensemble(members(where, method, url), method=method, progress=False)
    t0 = time.perf_counter()
    texts = [eng.generate(p, **kw).text for p, kw in requests()]
    return {"texts": texts, "seconds": round(time.perf_counter() - t0, 2)}


def timed(run, counts: list[int]) -> dict:
    """Tokens/s of `run(i)` in len(counts) threads at once, each adding its tokens to counts[i]."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(counts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"tokens": sum(counts), "seconds": round(wall, 3), "tokens_per_s": round(sum(counts) / wall, 2)}


def through_member(url: str, clients: int) -> dict:
    """Tokens/s of `single` through the server member, `clients` threads each running every prompt."""
    eng = Ensemble(members("server", "single", url), method="single", progress=False)
    eng.generate("Hi", max_new_tokens=4)  # connect, tokenizer
    counts = [0] * clients

    def run(i: int) -> None:
        for p in SPEED_PROMPTS:
            counts[i] += eng.generate(p, raw=True, max_new_tokens=SPEED_TOKENS).stats["tokens_out"]

    return timed(run, counts)


def server_alone(url: str, clients: int, shaped: bool = False) -> dict:
    """The server's own /completion on the same prompts (token ids from its /tokenize), greedy,
    SPEED_TOKENS each, `clients` threads each running every prompt: what a user of the server alone
    gets over the same HTTP, and the server's own ceiling on this machine with 8 at once. `shaped`:
    asked as the member asks (LOOKAHEAD tokens a request)."""
    import httpx

    counts = [0] * clients
    chunk = LOOKAHEAD if shaped else SPEED_TOKENS

    def run(i: int) -> None:
        http = httpx.Client(base_url=url, timeout=120)
        for p in SPEED_PROMPTS:
            ids = http.post("/tokenize", json={"content": p, "add_special": False}).json()["tokens"]
            for _ in range(0, SPEED_TOKENS, chunk):
                body = {"prompt": ids, "n_predict": chunk, "temperature": 0.0, "ignore_eos": True, "n_probs": 0}
                body.update(cache_prompt=True, return_tokens=True)
                got = http.post("/completion", json=body).json()["tokens"]
                ids, counts[i] = ids + got, counts[i] + len(got)

    return timed(run, counts)


def child(part: str, url: str, arg: str) -> dict:
    if part == "identity":
        where, method = arg.split(":")
        return identity(where, method, url)
    if part == "member":
        return through_member(url, int(arg))
    return server_alone(url, int(arg), shaped=part == "shaped")


def run_child(part: str, url: str, arg: str) -> dict:
    """One configuration in a fresh process."""
    out = subprocess.run([sys.executable, __file__, "--child", part, url, arg], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(path: str, speed_only: bool = False) -> None:
    gguf = fetch_bundled(BUNDLED[SMOL], progress=False)
    res: dict = {"identity": {}, "speed": {}}
    if speed_only:
        res = {**json.loads(Path(path).read_text()), "speed": {}}
    with build.launch(gguf, args=["--parallel", "8", "-c", "16384", "-t", "2"]) as url:
        for method in () if speed_only else METHODS:
            a, b = run_child("identity", url, f"server:{method}"), run_child("identity", url, f"local:{method}")
            same = sum(x == y for x, y in zip(a["texts"], b["texts"]))
            res["identity"][method] = {
                "same": same,
                "of": len(a["texts"]),
                "server_s": a["seconds"],
                "local_s": b["seconds"],
            }
            res["identity"][method]["differ"] = [[x, y] for x, y in zip(a["texts"], b["texts"]) if x != y]
            print(method, same, "/", len(a["texts"]), a["seconds"], b["seconds"], flush=True)
        for rnd in range(2):  # in turn, twice
            parts = {"server_alone": ("alone", "1"), "member_1_client": ("member", "1")}
            parts.update(server_alone_8_clients=("alone", "8"), member_8_clients=("member", "8"))
            parts.update(server_shaped_1_client=("shaped", "1"), server_shaped_8_clients=("shaped", "8"))
            got = {k: run_child(part, url, n) for k, (part, n) in parts.items()}
            res["speed"][f"round{rnd}"] = got
            print(rnd, got, flush=True)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(res, indent=1) + "\n")
    Path(path).with_suffix(".md").write_text(report(res))


def report(res: dict) -> str:
    """The results as the docs page's tables."""
    lines = ["## Greedy texts: SmolLM2 on llama-server + Gemma in process, against both in process", ""]
    lines += ["| method | same texts | seconds, server member | seconds, in process |", "|---|---|---|---|"]
    for m, r in res["identity"].items():
        lines.append(f"| {m} | {r['same']} of {r['of']} | {r['server_s']} | {r['local_s']} |")
    lines += ["", "## Tokens/s of `single` on SmolLM2 (loopback, the same llama-server)", ""]
    lines += ["| round | server alone | member | member / server | server, 8 clients | 8 / 1 | member, 8 | 8 / 1 |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    keys = ("server_alone", "member_1_client", "server_alone_8_clients", "member_8_clients")
    for rnd, r in res["speed"].items():
        a, one, a8, m8 = (r[k]["tokens_per_s"] for k in keys)
        lines.append(f"| {rnd} | {a} | {one} | {one / a:.2f} | {a8} | {a8 / a:.2f} | {m8} | {m8 / one:.2f} |")
    lines += [
        "",
        f"The server alone, asked as the member asks ({LOOKAHEAD} tokens a request, no log-probs):",
        "",
    ]
    lines += ["| round | 1 client | 8 clients | 8 / 1 | member, 8 / server so asked, 8 | member, 8 / server alone, 8 |"]
    lines += ["|---|---|---|---|---|---|"]
    for rnd, r in res["speed"].items():
        s1, s8, m8 = (
            r[k]["tokens_per_s"] for k in ("server_shaped_1_client", "server_shaped_8_clients", "member_8_clients")
        )
        a8 = r["server_alone_8_clients"]["tokens_per_s"]
        lines.append(f"| {rnd} | {s1} | {s8} | {s8 / s1:.2f} | {m8 / s8:.2f} | {m8 / a8:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], sys.argv[4])))
    else:
        main(sys.argv[1], speed_only="--speed" in sys.argv[2:])
