"""`ensemble-llm bench`: speed, cost and quality of every method side by side, in one run.

Every method gets the same prompts, interleaved (prompt by prompt, every method in turn) so that
machine noise hits all alike:
- speed prompts (chat, `max_new_tokens`): time per output token (the main member's tokens) and
  its ratios to `single-0` and to the main member's own `single`, time to the first streamed chunk,
  forward passes per member per output token, peak memory, and each method's own figures (member
  weights per prompt kind, E/T for safe/unite, Hedge weights for specfuse, ESS for smc);
- task files in the BIG-bench format (`{"input", "targets"}` per line): the first 3 lines are the
  shots of one "Q:/A:" prompt used by every method (a bundled suite task's prompt starts with
  its instruction line, `INSTRUCTIONS`), the next `examples` lines are scored by exact
  match (case-insensitive, whitespace and a trailing period ignored), greedy, first line only;
- chat tasks (file name starting with "chat", e.g. the bundled `chat_facts`): each input is one
  chat message (default settings, 48 new tokens), right when the answer contains an accepted
  answer; answers that repeat themselves are counted.
Writes results.json, results.md and PNG plots (quality vs time per token; time per token vs
number of members) into the output folder. Needs the `bench` extra (matplotlib, tqdm).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import torch

from .engine import Ensemble
from .errors import ConfigError
from .methods import get_method

SPEED_PROMPTS = [
    "What is the capital of France?",
    "Explain why the sky is blue.",
    "Write a short poem about autumn.",
    "Give three tips for staying healthy.",
    "What is photosynthesis?",
    "Describe a cat to a child.",
    "How do airplanes fly?",
    "Summarize the story of Cinderella.",
    "What are prime numbers?",
    "Write a haiku about the sea.",
    "Why do we have seasons?",
    "Name five fruits and their colours.",
    "What does a computer's CPU do?",
    "Explain gravity in simple words.",
    "How do you make a cup of tea?",
    "What is the tallest mountain in the world?",
    "Write a thank-you note to a friend.",
    "What is the difference between weather and climate?",
    "List the planets of the solar system.",
    "Why is reading important?",
]
# the defaults of `ensemble-llm bench`: about 35 minutes for the bundled pair on 2 CPU cores
DEFAULT_METHODS = ("single", "unite", "safe", "specfuse", "smc:n_particles=4")
# the multi-task dev suite (BIG-bench, generative, exact match): `--tasks suite` runs all seven
SUITE = (
    "qa_wikidata",
    "periodic_elements",
    "tense",
    "plural",
    "question_formation",
    "de_past_tense",
    "object_counting",
)
BUNDLED_TASKS = SUITE + ("chat_facts",)
# One instruction line heads each suite task's few-shot prompt (written once from the BIG-bench
# task descriptions, not tuned): with the bare "Q:/A:" shots the bundled members copy the input on
# plural (SmolLM2 9/30 right; 26/30 with the line). Task files of your own get no instruction.
INSTRUCTIONS = {
    "qa_wikidata": "Complete each fact with a short answer.",
    "periodic_elements": "Answer each question about the periodic table with the name of an element.",
    "tense": "Rewrite each sentence in the tense asked for.",
    "plural": "Give the plural form of each English noun.",
    "question_formation": "Turn each statement into a yes/no question.",
    "de_past_tense": "Give the past tense of each German verb.",
    "object_counting": "Answer each question with the number of objects asked for.",
}
BOOTSTRAP = 2000  # paired-bootstrap resamples for the 95% intervals
CHAT_TOKENS = 48  # budget of a chat-task answer
DEFAULT_TASKS = ("qa_wikidata:100", "chat_facts:45")


def bundled_task(name: str) -> Path:
    """A dev task file shipped with the package (the first 203 lines of the BIG-bench dev split),
    or the chat set `chat_facts` (45 factual questions with accepted answers, written for it)."""
    stem = name if name.startswith("chat") else f"{name}_dev"
    return Path(str(resources.files("ensemble_llm") / "data" / f"{stem}.jsonl"))


def is_chat_task(path: Path) -> bool:
    """Chat tasks (file name starting with 'chat'): each input is sent as one user message
    (chat template, defaults), and an answer is right when it contains an accepted answer."""
    return Path(path).name.startswith("chat")


def repeats(text: str, n: int = 6) -> bool:
    """The answer repeats itself: a sentence of 3+ words occurs twice, or a word n-gram does."""
    sentences = [x.strip().lower() for x in re.split(r"[.!?\n]+", text) if len(x.split()) >= 3]
    if len(sentences) != len(set(sentences)):
        return True
    words = re.findall(r"\w+", text.lower())
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return len(grams) != len(set(grams))


def contains_answer(text: str, targets: Sequence[str]) -> bool:
    low = text.lower()
    return any(t.lower() in low for t in targets)


def norm(s: str) -> str:
    return re.sub(r"\.$", "", s.strip().splitlines()[0].strip() if s.strip() else "").lower()


@dataclass
class MethodSpec:
    label: str
    method: str
    config: dict[str, Any] = field(default_factory=dict)
    members: list[str] | None = None  # None: the run's models


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_methods(specs: Sequence[str], n_members: int) -> list[MethodSpec]:
    """'single' (one per member), 'single:member=1', 'smc:f=min,n_particles=4', 'safe', ..."""
    out: list[MethodSpec] = []
    for spec in specs:
        name, _, rest = spec.partition(":")
        get_method(name)  # names the valid methods when unknown
        cfg: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            key, eq, val = item.partition("=")
            if not eq:
                raise ConfigError(f"method option {item!r} in {spec!r} must look like key=value")
            cfg[key.strip()] = _value(val.strip())
        if name == "single" and "member" not in cfg:
            out += [MethodSpec(f"single-{i}", "single", {"member": i}) for i in range(n_members)]
            continue
        label = name + (":" + ",".join(f"{k}={v}" for k, v in cfg.items()) if cfg else "")
        if name == "single":
            label = f"single-{cfg['member']}"
        out.append(MethodSpec(label, name, cfg))
    if not out:
        raise ConfigError("no methods to benchmark; give at least one, e.g. --methods single safe")
    return out


class PeakMemory:
    """Peak memory while a block runs: CUDA allocator peak on GPU, else resident set size sampled
    every 10 ms from /proc (Linux) - a process figure, so it includes the models already loaded."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0

    @staticmethod
    def rss() -> int:
        try:
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):  # not Linux: the process's lifetime peak
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self._stop = threading.Event()
        self.peak = self.rss()

        def sample() -> None:
            while not self._stop.wait(0.01):
                self.peak = max(self.peak, self.rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self.rss())


def resolve_task(item: str, default_n: int) -> tuple[Path, int]:
    """'qa_wikidata', 'qa_wikidata:200' or 'path/to/task.jsonl[:N]' -> (file, examples)."""
    name, n = item, default_n
    head, sep, tail = item.rpartition(":")
    if sep and tail.lstrip("-").isdigit():
        name, n = head, int(tail)
    if n < 1:
        raise ConfigError(f"task {name!r}: the number of examples must be >= 1, got {n}")
    path = bundled_task(name) if name in BUNDLED_TASKS else Path(name)
    if not path.is_file():
        raise ConfigError(f"task {name!r} is neither a bundled task ({', '.join(BUNDLED_TASKS)}) nor a file")
    return path, n


def resolve_tasks(items: Sequence[str], default_n: int) -> list[tuple[Path, int]]:
    """Task items; 'suite' or 'suite:N' stands for the seven suite tasks (N examples each)."""
    out = []
    for item in items:
        name, sep, tail = item.partition(":")
        if name == "suite":
            out += [resolve_task(f"{t}{sep}{tail}", default_n) for t in SUITE]
        else:
            out.append(resolve_task(item, default_n))
    return out


def bootstrap_diff(
    a: dict[str, Sequence[int]], b: dict[str, Sequence[int]], *, resamples: int = BOOTSTRAP, seed: int = 0
) -> dict[str, float]:
    """Paired bootstrap of the pooled accuracy difference a - b (in points, 0-100) over the tasks'
    examples: each resample draws every task's examples with replacement (stratified by task, so
    the task mix stays fixed), the same draws for a and b. Returns the difference and its 95%
    percentile interval."""
    import numpy as np

    rng = np.random.default_rng(seed)
    diffs = [np.asarray(a[t], dtype=float) - np.asarray(b[t], dtype=float) for t in a]
    n = sum(len(d) for d in diffs)
    if not n:
        return {"diff": 0.0, "low": 0.0, "high": 0.0, "examples": 0}
    total = np.zeros(resamples)
    for d in diffs:
        if len(d):
            total += d[rng.integers(0, len(d), size=(resamples, len(d)))].sum(axis=1)
    boot = 100.0 * total / n
    return {
        "diff": round(100.0 * float(sum(d.sum() for d in diffs)) / n, 2),
        "low": round(float(np.percentile(boot, 2.5)), 2),
        "high": round(float(np.percentile(boot, 97.5)), 2),
        "examples": n,
    }


def compare_to_members(quality: dict[str, dict]) -> dict[str, Any]:
    """Every ensemble method against the members alone, on the few-shot tasks: the pooled
    difference to the best single member (best pooled), to a per-task router (the better member
    on each task, chosen on the same data: an oracle a method has to match), and per task to
    that task's best member, each with a paired-bootstrap 95% interval (points)."""
    tasks = [t for t, q in quality.items() if not q["chat"]]
    if not tasks:
        return {}
    hits = {t: quality[t]["hits"] for t in tasks}
    labels = list(hits[tasks[0]])
    singles = [k for k in labels if k.startswith("single-")]
    if not singles:
        return {}
    score = {k: sum(sum(hits[t][k]) for t in tasks) for k in labels}
    best = max(singles, key=lambda k: (score[k], k))
    router = {t: hits[t][max(singles, key=lambda k: (sum(hits[t][k]), k))] for t in tasks}
    out: dict[str, Any] = {
        "tasks": tasks,
        "best_single": best,
        "router_correct": sum(sum(v) for v in router.values()),
        "methods": {},
    }
    for k in labels:
        if k in singles:
            continue
        mine = {t: hits[t][k] for t in tasks}
        row = {
            "vs_best_single": bootstrap_diff(mine, {t: hits[t][best] for t in tasks}),
            "vs_router": bootstrap_diff(mine, router),
            "per_task": {},
        }
        for t in tasks:
            task_best = max(singles, key=lambda s: (sum(hits[t][s]), s))
            row["per_task"][t] = {"best_single": task_best, **bootstrap_diff({t: mine[t]}, {t: hits[t][task_best]})}
        out["methods"][k] = row
    return out


def load_task(path: Path, n: int) -> tuple[str, list[dict]]:
    try:
        lines = [json.loads(x) for x in Path(path).read_text(encoding="utf-8").splitlines() if x.strip()]
        for i, x in enumerate(lines):
            if not isinstance(x.get("input"), str) or not x.get("targets"):
                raise ValueError(f"line {i + 1} lacks an 'input' string or a non-empty 'targets' list")
    except (ValueError, AttributeError) as exc:
        raise ConfigError(
            f"task file {path} is not in the BIG-bench jsonl format "
            f'({{"input": ..., "targets": [...]}} per line): {exc}'
        ) from None
    if is_chat_task(path):
        return "", lines[:n]
    if len(lines) < 4:
        raise ConfigError(f"task file {path} needs at least 4 lines (3 shots + 1 example), has {len(lines)}")
    shots = "".join(f"Q: {x['input'].strip()}\nA: {x['targets'][0]}\n" for x in lines[:3])
    name = Path(path).stem.removesuffix("_dev")
    if name in INSTRUCTIONS and Path(path) == bundled_task(name):
        shots = INSTRUCTIONS[name] + "\n\n" + shots
    return shots, lines[3 : 3 + n]


def _progress(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - the bench extra brings tqdm
        tqdm = None
    if tqdm is None or not enabled:

        class _Null:
            def update(self, n=1): ...
            def set_postfix_str(self, s): ...
            def close(self): ...

        return _Null()
    return tqdm(total=total, unit="gen", dynamic_ncols=True)


def run_bench(
    models: Sequence[str],
    methods: Sequence[MethodSpec],
    tasks: Sequence[tuple[Path, int]],
    *,
    speed_prompts: int = 5,
    max_new_tokens: int = 64,
    third_member: str | None = None,
    device: str = "auto",
    progress: bool = True,
    preambles: bool = True,
) -> dict:
    """Run the benchmark and return the results dict (see module docstring)."""
    models = list(models)
    specs = list(methods)
    if not 0 <= speed_prompts <= len(SPEED_PROMPTS):
        raise ConfigError(f"speed_prompts must be between 0 and {len(SPEED_PROMPTS)}, got {speed_prompts}")
    if speed_prompts and max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not speed_prompts and not tasks:
        raise ConfigError("nothing to run: give speed prompts or at least one task")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"a method is listed twice: {sorted({x for x in labels if labels.count(x) > 1})}")
    if third_member:  # the members-scaling section: every ensemble method again with 3 members
        specs += [
            MethodSpec(s.label + "+3", s.method, s.config, models + [third_member])
            for s in methods
            if s.method != "single"
        ]

    def members_of(spec: MethodSpec) -> list:  # preambles=False: none, the base-model one included
        names = list(spec.members or models)
        return names if preambles else [{"model": m, "preamble": []} for m in names]

    engines = {s.label: Ensemble(members_of(s), s.method, s.config, device=device, progress=progress) for s in specs}
    for eng in engines.values():
        eng.load()
        eng.generate("Hello, who are you?", max_new_tokens=4)  # warm-up, outside the timings
    first = next(iter(engines.values())).members
    task_data = {Path(t).stem.removesuffix("_dev"): load_task(Path(t), n) for t, n in tasks}
    chat_tasks = {Path(t).stem.removesuffix("_dev") for t, _ in tasks if is_chat_task(Path(t))}
    if len(task_data) != len(tasks):
        raise ConfigError("two tasks have the same file name; rename one")
    n_gen = len(engines) * (speed_prompts + sum(len(ex) for _, ex in task_data.values()))
    bar = _progress(n_gen, progress)
    speed = {k: {"time": 0.0, "tokens": 0, "bytes": 0, "ttfc": [], "fwd": {}, "peak": 0, "extra": []} for k in engines}
    t_start = time.perf_counter()
    for p in SPEED_PROMPTS[:speed_prompts]:
        for key, eng in engines.items():
            with PeakMemory(eng.members[0].device) as mem:
                r = eng.generate(p, max_new_tokens=max_new_tokens)
            s = speed[key]
            s["time"] += r.stats["time_s"]
            s["tokens"] += r.stats.get("tokens_out", 0)
            s["bytes"] += len(r.text.encode("utf-8"))
            s["ttfc"].append(r.stats["time_to_first_chunk_s"] or r.stats["time_s"])
            s["peak"] = max(s["peak"], mem.peak)
            for name, f in r.stats["members"].items():
                s["fwd"][name] = s["fwd"].get(name, 0) + f["forward_passes"]
            s["extra"].append(r.run_stats)
            bar.update()
            bar.set_postfix_str(f"speed: {key}")
    quality: dict[str, dict[str, Any]] = {}
    for task, (shots, exs) in task_data.items():
        main = first[0]
        chat = task in chat_tasks
        longest = max(len(main.encode(t)) for ex in exs for t in ex["targets"])
        budget = CHAT_TOKENS if chat else min(64, longest + 4)
        right = dict.fromkeys(engines, 0)
        repeating = dict.fromkeys(engines, 0)
        seconds = dict.fromkeys(engines, 0.0)
        samples: dict[str, list] = {k: [] for k in engines}
        hits: dict[str, list[int]] = {k: [] for k in engines}  # per example, for the paired bootstrap
        for ex in exs:
            prompt = shots + f"Q: {ex['input'].strip()}\nA:"
            gold = {norm(t) for t in ex["targets"]}
            for key, eng in engines.items():
                if chat:
                    res = eng.generate(ex["input"], max_new_tokens=budget)
                else:
                    res = eng.generate(prompt, max_new_tokens=budget, raw=True, stop=["\n"])
                out = res.text
                seconds[key] += res.stats["time_s"]
                ok = contains_answer(out, ex["targets"]) if chat else norm(out) in gold
                repeating[key] += chat and repeats(out)
                right[key] += ok
                hits[key].append(int(ok))
                if len(samples[key]) < 3:
                    samples[key].append({"input": ex["input"], "output": out.strip(), "correct": ok})
                bar.update()
                bar.set_postfix_str(f"{task}: {key}")
        quality[task] = {
            "examples": len(exs),
            "max_new_tokens": budget,
            "chat": chat,
            "accuracy": {k: v / max(1, len(exs)) for k, v in right.items()},
            "correct": right,
            "repeating": repeating if chat else None,
            "seconds": {k: round(v, 2) for k, v in seconds.items()},
            "samples": samples,
            "hits": hits,
        }
    bar.close()
    total_s = time.perf_counter() - t_start

    base = "single-0" if "single-0" in engines else None
    results: dict[str, Any] = {
        "models": models,
        "third_member": third_member,
        "preambles": preambles,
        "devices": sorted({str(m.device) for e in engines.values() for m in e.members}),
        "dtype": str(first[0].dtype),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "speed_prompts": speed_prompts,
        "max_new_tokens": max_new_tokens,
        "examples_per_task": {t: q["examples"] for t, q in quality.items()},
        "wall_time_s": round(total_s, 1),
        "methods": {},
    }
    for spec in specs:
        key = spec.label
        s = speed[key]
        per_tok = s["time"] / max(1, s["tokens"])
        row: dict[str, Any] = {
            "method": spec.method,
            "config": spec.config,
            "members": 1 if spec.method == "single" else len(engines[key].members),
            "time_per_token_s": per_tok,
            "tokens": s["tokens"],
            "time_to_first_chunk_s": statistics.median(s["ttfc"]) if s["ttfc"] else None,
            "forward_passes_per_token": {n: v / max(1, s["tokens"]) for n, v in s["fwd"].items()},
            "bytes_per_s": s["bytes"] / s["time"] if s["time"] else None,
            "forward_passes_per_byte": {n: v / max(1, s["bytes"]) for n, v in s["fwd"].items()},
            "peak_memory_mb": round(s["peak"] / 2**20, 1),
            "accuracy": {t: q["accuracy"][key] for t, q in quality.items()},
            "correct": {t: q["correct"][key] for t, q in quality.items()},
            "repeating": {t: q["repeating"][key] for t, q in quality.items() if q["chat"]},
            "task_seconds": {t: q["seconds"][key] for t, q in quality.items()},
            "speed_seconds": round(s["time"], 2),
        }
        if quality:
            row["pooled_accuracy"] = pooled(row["accuracy"], results["examples_per_task"])
        row.update(_method_figures(spec.method, s["extra"]))
        eng = engines[key]
        if spec.method != "single" and len(eng.members) > 1:
            names = [m.name for m in eng.members]
            row["weights_by_kind"] = {}
            for kind in ("chat", "raw"):
                w, main = eng.member_weights(kind)
                row["weights_by_kind"][kind] = {
                    "weights": dict(zip(names, [round(x, 4) for x in w])),
                    "main": names[main],
                }
        results["methods"][key] = row
    if base and results["methods"][base]["time_per_token_s"] > 0:
        for row in results["methods"].values():
            row["ratio_to_single_0"] = row["time_per_token_s"] / results["methods"][base]["time_per_token_s"]
    add_main_ratios(results, [m.name for m in first])
    results["samples"] = {t: q["samples"] for t, q in quality.items()}
    results["hits"] = {t: q["hits"] for t, q in quality.items()}
    results["comparison"] = compare_to_members(quality)
    return results


def add_main_ratios(results: dict, names: Sequence[str]) -> None:
    """Time per token against the method's own main member alone (its tokens count the budget),
    "safe at 1.5x its drafter" whichever member drafts the chat prompts. `names`: member names."""
    names = list(names)
    for row in results["methods"].values():
        main = row.get("weights_by_kind", {}).get("chat", {}).get("main") or (
            names[row["config"].get("member", 0)] if row["method"] == "single" else None
        )
        if isinstance(row["config"].get("drafter"), int):  # an explicit drafter wins
            main = names[row["config"]["drafter"]]
        alone = results["methods"].get(f"single-{names.index(main)}") if main in names else None
        if alone and alone["time_per_token_s"] > 0 and row["time_per_token_s"] > 0:
            row["main_member_speed"] = main
            row["ratio_to_main_alone"] = row["time_per_token_s"] / alone["time_per_token_s"]


def pooled(accuracy: dict[str, float], examples: dict[str, int]) -> float:
    """Accuracy over all scored examples of all tasks together."""
    n = sum(examples[t] for t in accuracy)
    return sum(accuracy[t] * examples[t] for t in accuracy) / n if n else 0.0


def _method_figures(method: str, stats: list) -> dict[str, Any]:
    """The method's own figures over the speed runs, as the method summarizes them."""
    return get_method(method).stats_class.summarize(stats) if stats else {}


def markdown(results: dict) -> str:
    tasks = list(next(iter(results["methods"].values()))["accuracy"]) if results["methods"] else []
    head = (
        [
            "method",
            "members",
            "s/token",
            "x single-0",
            "x main alone",
            "bytes/s",
            "TTFC s",
            "fwd/token",
            "fwd/byte",
            "peak MB",
        ]
        + tasks
        + (["pooled", "s/example"] if tasks else [])
        + ["figures"]
    )
    lines = [
        f"# ensemble-llm bench: {', '.join(results['models'])} on {', '.join(results['devices'])}",
        "",
        ("" if results.get("preambles", True) else "No member has a preamble (--no-preamble). ")
        + f"{results['speed_prompts']} speed prompts x {results['max_new_tokens']} new tokens; task examples "
        f"(3-shot, exact match): {', '.join(f'{t} {n}' for t, n in results['examples_per_task'].items()) or 'none'}; "
        f"whole run {results['wall_time_s'] / 60:.1f} min.",
        "",
        *([f"Command: `{results['command']}`", ""] if results.get("command") else []),
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for label, r in results["methods"].items():
        fwd = ", ".join(f"{v:.2f}" for v in r["forward_passes_per_token"].values())
        figs = []
        for kind, wk in r.get("weights_by_kind", {}).items():
            figs.append(f"{kind} w " + "/".join(f"{w:.2f}" for w in wk["weights"].values()) + f" (main {wk['main']})")
        if "ensembled_fraction" in r:
            figs.append(f"E/T {r['ensembled_fraction']:.0%}")
        if "hedge_weights_mean" in r:
            figs.append("Hedge " + "/".join(f"{w:.2f}" for w in r["hedge_weights_mean"].values()))
        if r.get("ess_mean") is not None:
            figs.append(f"ESS {r['ess_mean']:.1f}, resample/step {r['resamplings_per_step']:.2f}")
        elif r.get("search") == "beam":
            figs.append("beam search (T=0)")
        ttfc = r["time_to_first_chunk_s"]
        fwd_b = ", ".join(f"{v:.2f}" for v in r.get("forward_passes_per_byte", {}).values())
        bps = r.get("bytes_per_s")
        timed = bool(results["speed_prompts"])  # no speed prompts: the speed columns stay empty
        cells = [
            label,
            str(r["members"]),
            f"{r['time_per_token_s']:.4f}" if timed else "",
            f"{r['ratio_to_single_0']:.2f}" if "ratio_to_single_0" in r else "",
            f"{r['ratio_to_main_alone']:.2f}" if "ratio_to_main_alone" in r else "",
            "" if bps is None else f"{bps:.1f}",
            "" if ttfc is None else f"{ttfc:.2f}",
            fwd,
            fwd_b,
            f"{r['peak_memory_mb']:.0f}" if timed else "",
        ]
        cells += [
            f"{r['accuracy'][t]:.1%}" + (f" ({r['repeating'][t]} rep.)" if t in r.get("repeating", {}) else "")
            for t in tasks
        ]
        if tasks:
            per_ex = ", ".join(f"{r['task_seconds'][t] / max(1, results['examples_per_task'][t]):.2f}" for t in tasks)
            cells += [f"{pooled(r['accuracy'], results['examples_per_task']):.1%}", per_ex]
        cells += ["; ".join(figs)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "s/token: per output token of the method's main member (chat prompts: the member with the largest "
        "chat weight); x main alone: that time over the main member's own `single` in this run. "
        "s/example: mean seconds per task example, one figure per task in column order. "
        "fwd/token, fwd/byte: forward passes per output token or UTF-8 byte, one "
        "figure per member (a batched forward counts once). "
        "Peak MB: CUDA allocator peak on GPU; on CPU the process's resident memory, models included.",
    ]
    lines += comparison_markdown(results.get("comparison") or {})
    return "\n".join(lines) + "\n"


def comparison_markdown(cmp: dict[str, Any]) -> list[str]:
    """The few-shot tasks: each ensemble against the best member, the per-task router and, per
    task, that task's best member (differences in points, paired-bootstrap 95% intervals)."""
    if not cmp or not cmp.get("methods"):
        return []
    tasks = cmp["tasks"]

    def cell(d: dict) -> str:
        return f"{d['diff']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]"

    first = next(iter(cmp["methods"].values()))
    n = first["vs_best_single"]["examples"]
    lines = [
        "",
        f"## Against the members alone ({n} few-shot examples pooled)",
        "",
        f"Points of accuracy, paired-bootstrap 95% interval in brackets. Best member pooled: "
        f"{cmp['best_single']}; the per-task router (the better member on each task, chosen on these "
        f"data) gets {cmp['router_correct']}/{n}. Per task: against that task's best member.",
        "",
        "| method | vs best member | vs per-task router | " + " | ".join(tasks) + " |",
        "|" + "---|" * (3 + len(tasks)),
    ]
    for label, row in cmp["methods"].items():
        lines.append(
            f"| {label} | {cell(row['vs_best_single'])} | {cell(row['vs_router'])} | "
            + " | ".join(cell(row["per_task"][t]) for t in tasks)
            + " |"
        )
    return lines


def plots(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    rows = results["methods"]
    if results["examples_per_task"]:
        fig, ax = plt.subplots(figsize=(7.2, 4.8))
        seen: dict[tuple[float, float], int] = {}
        x_max = max(v["time_per_token_s"] for v in rows.values()) or 1.0
        for label, r in rows.items():
            if r["members"] > len(results["models"]):
                continue
            x, y = r["time_per_token_s"], pooled(r["accuracy"], results["examples_per_task"]) * 100
            ax.scatter(x, y, s=40)
            # labels of nearby points are stacked, not overprinted
            spot = (round(20 * x / x_max), round(y / 2))
            k = seen[spot] = seen.get(spot, -1) + 1
            ax.annotate(label, (x, y), fontsize=8, xytext=(5, 3 - 10 * k), textcoords="offset points")
        ax.set_xlabel("seconds per output token (speed prompts)")
        ax.set_ylabel("exact-match accuracy, all task examples pooled (%)")
        ax.set_title(f"Quality vs time ({', '.join(results['devices'])})")
        made.append(_save(fig, ax, out / "quality_vs_time.png"))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    by_method: dict[str, list[tuple[int, float]]] = {}
    for label, r in rows.items():
        name = "single" if r["method"] == "single" else label.removesuffix("+3")
        if r["method"] == "single" and label != "single-0":
            continue
        by_method.setdefault(name, []).append((r["members"], r["time_per_token_s"]))
    single = by_method.pop("single", [])
    for name, pts in by_method.items():
        pts = sorted(single + pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("members")
    ax.set_ylabel("seconds per output token")
    ax.set_xticks(sorted({p[0] for pts in by_method.values() for p in pts} | {p[0] for p in single}))
    ax.set_title("Time per token vs number of members (1 = single drafter)")
    ax.legend(fontsize=8)
    made.append(_save(fig, ax, out / "time_vs_members.png"))
    return made


def _save(fig, ax, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "results.md").write_text(markdown(results))
    return [out / "results.json", out / "results.md"] + plots(results, out)
