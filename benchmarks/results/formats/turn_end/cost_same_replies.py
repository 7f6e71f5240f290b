import json
import time

from ensemble_llm import Ensemble

P = json.load(open("/tmp/same_prompts.json"))
eng = Ensemble(["smollm2-135m-instruct", "gemma-3-270m"], "auto").load()
eng.generate(P[0], max_new_tokens=4)
t0 = time.perf_counter()
out = []
for p in P:
    out.append(eng.generate(p, max_new_tokens=48).text)
print(json.dumps({"s": round(time.perf_counter() - t0, 2), "bytes": sum(len(x.encode()) for x in out)}))
