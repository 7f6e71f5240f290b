"""llama-cpp-python builds and llama.cpp configurations on this machine, each in a fresh process.

For each build (the installed one, built as the README says, and optionally another, e.g. one
built with native flags: `--other DIR` of a `pip install --target DIR` of the same sdist) and each
configuration (llama.cpp's extra buffer types on, then off):
- the health check's child probe (members/backends/llama_cpp/probe.py): survives, or the signal that killed it;
- where it survives: `single` on each bundled member (decode tokens/s, a 64-token greedy reply on
  three raw prompts, best of two), and for the configuration with extra buffer types, llama-cpp-
  python's own `Llama.__call__` on the same prompt ids (it has no switch for them);
- the 160 calibration log-likelihoods the package ships (data/calibration_bundled.json), measured
  in that configuration: the largest difference from the shipped figures and between
  configurations, which sets the tolerance of tests/test_calibration_shipped.py.

    python benchmarks/llama_builds.py --other /tmp/native-lcp --out benchmarks/results/llama_builds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PAIR = ("smollm2-135m-instruct", "gemma-3-270m")
PROMPTS = ["The history of the printing press", "A recipe for bread:", "Once upon a time, in a small village,"]

CHILD = r"""
import json, sys, time
from ensemble_llm.members.backends.llama_cpp import health as llama_health

extra = sys.argv[1] == "1"
forced = llama_health.Verdict(extra, ("forced by the bench",), "bench")
llama_health.verdict = lambda gguf, cache_dir=None: forced  # this process runs the configuration asked for

from ensemble_llm import Ensemble
from ensemble_llm.calibrate import SHOTS, Calibrator, as_question, raw_prompt, target_logprob
from ensemble_llm.members.backends.llama_cpp.member import cpu_cores
from ensemble_llm.members.loader import gguf_file, resolve_source

PAIR, PROMPTS = json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {"speed": {}, "calibration": {}}
for name in PAIR:
    with Ensemble([name], method="single", progress=False) as engine:
        m = engine.load()._members[0]
        assert m.runner.extra_bufts is extra
        runs = {"single": lambda p: engine.generate(p, max_new_tokens=64, raw=True).usage.completion_tokens}
        if extra:
            import llama_cpp
            path = str(gguf_file(resolve_source(name)))
            llm = llama_cpp.Llama(path, n_ctx=2048, n_threads=cpu_cores(), verbose=False)
            def call(p, llm=llm):
                llm.reset()
                return llm(m.prompt_ids(p), max_tokens=64, temperature=0.0, top_k=1)["usage"]["completion_tokens"]
            runs["llama_cpp_Llama"] = call
        for run in runs.values():
            run(PROMPTS[0])
        for label, run in runs.items():
            best = 0.0
            for _ in range(2):
                n, t0 = 0, time.perf_counter()
                for p in PROMPTS:
                    n += run(p)
                best = max(best, n / (time.perf_counter() - t0))
            out["speed"][f"{label}:{name}"] = round(best, 2)
        data = Calibrator().data
        for kind in ("raw", "chat"):
            figures = []
            for j in range(SHOTS, len(data)):
                if kind == "raw":
                    ids, target = m.prompt_ids(raw_prompt(data, j)), " " + data[j]["targets"][0] + "\n"
                else:
                    ids, target = m.prompt_ids(engine._chat_prompt(0, as_question(data[j]["input"]))), data[j]["reply"]
                figures.append(target_logprob(m, ids, target))
            out["calibration"][f"{kind}:{name}|null|torch.float32|llama.cpp"] = figures
print(json.dumps(out))
"""


def env_for(lib_dir: str | None) -> dict:
    env = dict(os.environ)
    if lib_dir:
        env["PYTHONPATH"] = os.pathsep.join([lib_dir, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_config(lib_dir: str | None, extra: bool, gguf: Path) -> dict:
    """The probe, and where it survives, the speed and calibration figures, in fresh processes."""
    env = env_for(lib_dir)
    probe = [sys.executable, "-c", "import sys; from ensemble_llm.members.backends.llama_cpp.health import probe; "
             "o, _ = probe(__import__('pathlib').Path(sys.argv[1]), sys.argv[2] == '1'); print(o or 'ok')",
             str(gguf), "1" if extra else "0"]  # fmt: skip
    outcome = subprocess.run(probe, capture_output=True, text=True, env=env, check=True).stdout.strip()
    row = {"probe": outcome}
    if outcome == "ok":
        cmd = [sys.executable, "-c", CHILD, "1" if extra else "0", json.dumps(PAIR), json.dumps(PROMPTS)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        row.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return row


def spread(a: dict, b: dict) -> float:
    """The largest absolute difference between two sets of calibration figures (nats)."""
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", help="a folder holding another build of llama-cpp-python (pip install --target)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/llama_builds"))
    args = ap.parse_args()
    from ensemble_llm.calibrate import Calibrator, bundled_logliks
    from ensemble_llm.members.loader import gguf_file, resolve_source

    gguf = gguf_file(resolve_source(PAIR[0]), progress=False)
    builds = {"installed (README: no native flags)": None} | ({"other (--other)": args.other} if args.other else {})
    rows = {}
    for build, lib_dir in builds.items():
        for extra in (True, False):
            label = f"{build}, extra buffer types {'on' if extra else 'off'}"
            rows[label] = run_config(lib_dir, extra, gguf)
            print(label, json.dumps({k: v for k, v in rows[label].items() if k != "calibration"}), flush=True)
    shipped = bundled_logliks(Calibrator().digest)
    measured = {k: r["calibration"] for k, r in rows.items() if "calibration" in r}
    labels = list(measured)
    result = {
        "cpu": _cpu(),
        "rows": rows,
        "calibration_max_abs_diff_to_shipped": {k: round(spread(shipped, v), 4) for k, v in measured.items()},
        "calibration_max_abs_diff_between": {
            f"{a} | {b}": round(spread(measured[a], measured[b]), 4)
            for i, a in enumerate(labels)
            for b in labels[i + 1 :]
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "results.md").write_text(report(result))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


def report(res: dict) -> str:
    """The table of every build and configuration, and the calibration figures' spread."""
    cols = [f"{run}:{name}" for name in PAIR for run in ("single", "llama_cpp_Llama")]
    lines = [
        f"CPU: {res['cpu']}. Each row in fresh processes; tokens/s of 64-token greedy replies to three raw "
        "prompts (best of two passes). `llama_cpp_Llama` is llama-cpp-python's own `Llama.__call__` (it always "
        "uses the extra buffer types).",
        "",
        "| build, configuration | child probe | "
        + " | ".join(c.replace(":", " ") for c in cols)
        + " | calibration: max abs diff to the shipped figures (nat) |",
        "|---|---|" + "---|" * len(cols) + "---|",
    ]
    for label, row in res["rows"].items():
        speed = row.get("speed", {})
        cells = [f"{speed[c]:.1f}" if c in speed else "-" for c in cols]
        diff = res["calibration_max_abs_diff_to_shipped"].get(label)
        lines.append(f"| {label} | {row['probe']} | " + " | ".join(cells) + f" | {'-' if diff is None else diff} |")
    lines += ["", "Calibration figures between configurations (max abs diff, nat):", ""]
    lines += [f"- {pair}: {d}" for pair, d in res["calibration_max_abs_diff_between"].items()]
    return "\n".join(lines) + "\n"


def _cpu() -> str:
    from ensemble_llm.members.backends.llama_cpp.health import cpu_flags

    lines = cpu_flags().splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return f"{model}; {' '.join(f for f in flags if f.startswith(('amx', 'avx512f', 'avx2')))}"


if __name__ == "__main__":
    main()
