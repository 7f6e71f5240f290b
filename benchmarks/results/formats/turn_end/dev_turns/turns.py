"""Dev check: 3 shots as chat turns on the bigbench dev files. usage: turns.py CONFIG OUT"""

import json
import re
import sys
from pathlib import Path

from ensemble_llm import Ensemble

PAIR = ["smollm2-135m-instruct", "gemma-3-270m"]
cfg, out = sys.argv[1], Path(sys.argv[2])
members, method = {"s0": ([PAIR[0]], "single"), "s1": ([PAIR[1]], "single")}.get(cfg, (PAIR, cfg))
D = Path("/work/shared/data/bigbench")
TASKS = ["de_past_tense", "plural", "question_formation", "qa_wikidata", "periodic_elements", "object_counting"]
N = 50


def norm(s):
    s = s.strip().splitlines()[0].strip() if s.strip() else ""
    return re.sub(r"\.$", "", s).lower()


done = {json.loads(x)["key"] for x in out.open()} if out.exists() else set()
with Ensemble(members, method) as eng, out.open("a") as fh:
    for t in TASKS:
        rows = [json.loads(x) for x in open(D / f"{t}_dev.jsonl")]
        shots, items = rows[:3], rows[3 : 3 + N]
        for it in items:
            key = f"{t}:{it['input']}"
            if key in done:
                continue
            msgs = [
                m
                for s in shots
                for m in ({"role": "user", "content": s["input"]}, {"role": "assistant", "content": s["targets"][0]})
            ]
            msgs.append({"role": "user", "content": it["input"]})
            r = eng.generate(msgs, max_new_tokens=24)
            ok = norm(r.text) in {norm(x) for x in it["targets"]}
            fh.write(
                json.dumps(
                    {
                        "key": key,
                        "task": t,
                        "reply": r.text,
                        "right": ok,
                        "copy": r.stats.get("copy"),
                        "aside": r.stats.get("aside"),
                    }
                )
                + "\n"
            )
            fh.flush()
