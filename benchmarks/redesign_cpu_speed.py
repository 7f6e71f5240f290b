"""Process CPU seconds (and wall seconds) per output token of each method on the bundled pair:
3 chat speed prompts x 40 tokens after a warm-up. CPU time is steadier than wall time on a shared
VM; run it once per tree, alternating, and compare (see results/redesign/results.md)."""

import json
import time

from ensemble_llm import Ensemble
from ensemble_llm.bench import SPEED_PROMPTS


def main() -> None:
    out = {}
    for method in ["single", "unite", "safe", "specfuse"]:
        eng = Ensemble(method=method, config={"member": 0} if method == "single" else None, progress=False)
        eng.generate("Hello, who are you?", max_new_tokens=4)
        c0, w0, toks = time.process_time(), time.perf_counter(), 0
        for p in SPEED_PROMPTS[:3]:
            toks += eng.generate(p, max_new_tokens=40).stats.get("tokens_out", 0)
        out[method] = {
            "cpu_s_per_token": (time.process_time() - c0) / toks,
            "wall_s_per_token": (time.perf_counter() - w0) / toks,
            "tokens": toks,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
