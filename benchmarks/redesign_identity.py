"""Every method's texts on fixed requests, for checking that a refactor changed no output.

Run it with two trees (e.g. `git archive <rev> | tar -x -C /tmp/old`) and compare the JSON files:

    PYTHONPATH=/tmp/old python benchmarks/redesign_identity.py before.json
    python benchmarks/redesign_identity.py after.json

A second argument names the members' backend ("llama.cpp", "transformers"; default: "auto").

Requests per method on the bundled pair: 14 qa_wikidata few-shot prompts (raw, stop "\\n"), chat
prompts (one with a stop string), a JSON Schema response_format, a forced tool call (its raw text,
markup included) and one sampled reply with a seed. smc (3 particles) runs one chat prompt.
"""

from __future__ import annotations

import json
import sys
import time

from ensemble_llm import Ensemble
from ensemble_llm.bench import bundled_task, load_task
from ensemble_llm.members.registry import DEFAULT_MODELS

CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "Describe a cat to a child."]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
METHODS = [("single", None), ("unite", None), ("safe", None), ("specfuse", None), ("smc", {"n_particles": 3})]


def texts(method: str, config, backend: str = "auto") -> list[str]:
    members = [{"model": name, "backend": backend} for name in DEFAULT_MODELS]
    eng = Ensemble(members, method=method, config=config, progress=False)
    shots, examples = load_task(bundled_task("qa_wikidata"), 14)
    rows = []
    for ex in examples:
        prompt = shots + "Q: " + ex["input"].strip() + "\nA:"
        rows.append(eng.generate(prompt, raw=True, max_new_tokens=12, stop=["\n"]).text)
    for c in CHAT[: 1 if method == "smc" else 3]:
        rows.append(eng.generate(c, max_new_tokens=40, stop=["cat"] if "cat" in c else None).text)
    fmt = {"type": "json_schema", "json_schema": {"schema": PERSON}}
    rows.append(eng.generate("Make up a person.", max_new_tokens=40, response_format=fmt).text)
    rows.append(
        eng.generate("Weather in Paris?", max_new_tokens=40, tools=[WEATHER], tool_choice="get_weather").raw_text
    )
    rows.append(eng.generate("Say hi", max_new_tokens=20, temperature=0.8, seed=3).text)
    return rows


def main(out: str, backend: str = "auto") -> None:
    results = {}
    for method, config in METHODS:
        t0 = time.time()
        results[method] = texts(method, config, backend)
        print(method, round(time.time() - t0, 1), file=sys.stderr, flush=True)
    with open(out, "w") as fh:
        json.dump(results, fh, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main(*sys.argv[1:3])
