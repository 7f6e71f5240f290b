"""`run_bench` (floor 5): every method on the same speed prompts and task examples, interleaved
(prompt by prompt, every method in turn) so that machine noise hits all alike."""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from ..engine import Ensemble
from ..errors import ConfigError
from ..methods import get_method
from .specs import MethodSpec
from .stats import compare_to_members, pooled
from .tasks import CHAT_TOKENS, contains_answer, is_chat_task, norm, repeats, task_prompts

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
    shots: str = "fixed",
) -> dict:
    """Run the benchmark and return the results dict (see the package docstring). `shots`: the
    few-shot reading ("fixed": the task's first three lines; "drawn": each example's own)."""
    models = list(models)
    specs = _specs(models, methods, tasks, speed_prompts, max_new_tokens, third_member)

    def members_of(spec: MethodSpec) -> list:  # preambles=False: none, the base-model one included
        names = list(spec.members or models)
        return names if preambles else [{"model": m, "preamble": []} for m in names]

    engines = {s.label: Ensemble(members_of(s), s.method, s.config, device=device, progress=progress) for s in specs}
    for eng in engines.values():
        eng.load()
        eng.generate("Hello, who are you?", max_new_tokens=4)  # warm-up, outside the timings
    first = next(iter(engines.values())).members
    task_data = {Path(t).stem.removesuffix("_dev"): task_prompts(Path(t), n, shots) for t, n in tasks}
    chat_tasks = {Path(t).stem.removesuffix("_dev") for t, _ in tasks if is_chat_task(Path(t))}
    if len(task_data) != len(tasks):
        raise ConfigError("two tasks have the same file name; rename one")
    bar = _progress(len(engines) * (speed_prompts + sum(len(ex) for ex in task_data.values())), progress)
    t_start = time.perf_counter()
    speed = _speed(engines, speed_prompts, max_new_tokens, bar)
    quality = {
        task: _task_quality(engines, task, exs, task in chat_tasks, first[0], bar) for task, exs in task_data.items()
    }
    bar.close()
    results = _header(models, third_member, preambles, engines, speed_prompts, max_new_tokens, quality, t_start)
    results["shots"] = shots
    for spec in specs:
        results["methods"][spec.label] = _method_row(spec, engines[spec.label], speed[spec.label], quality, results)
    base = "single-0" if "single-0" in engines else None
    if base and results["methods"][base]["time_per_token_s"] > 0:
        for row in results["methods"].values():
            row["ratio_to_single_0"] = row["time_per_token_s"] / results["methods"][base]["time_per_token_s"]
    add_main_ratios(results, [m.name for m in first])
    results["samples"] = {t: q["samples"] for t, q in quality.items()}
    results["hits"] = {t: q["hits"] for t, q in quality.items()}
    results["outputs"] = {t: q["outputs"] for t, q in quality.items()}
    results["comparison"] = compare_to_members(quality)
    return results


def _header(models, third_member, preambles, engines, speed_prompts, max_new_tokens, quality, t_start) -> dict:
    """The run's setting: members, devices, dtype, versions, machine, budgets, examples, wall time."""
    first = next(iter(engines.values())).members
    return {
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
        "wall_time_s": round(time.perf_counter() - t_start, 1),
        "methods": {},
    }


def _specs(models, methods, tasks, speed_prompts: int, max_new_tokens: int, third_member) -> list[MethodSpec]:
    """The run's method specs, checked; with a third member, every ensemble method again with 3."""
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
    return specs


def _speed(engines: dict[str, Ensemble], speed_prompts: int, max_new_tokens: int, bar) -> dict[str, dict]:
    """The speed prompts, every engine in turn: time, tokens, bytes, time to the first chunk,
    forward passes per member, peak memory and the method's own figures."""
    speed = {k: {"time": 0.0, "tokens": 0, "bytes": 0, "ttfc": [], "fwd": {}, "peak": 0, "extra": []} for k in engines}
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
            if isinstance(r.run_stats, eng.method_class.stats_class):  # not a request a member ran alone
                s["extra"].append(r.run_stats)
            bar.update()
            bar.set_postfix_str(f"speed: {key}")
    return speed


def _task_quality(engines: dict[str, Ensemble], task: str, prompts: list, chat: bool, main, bar) -> dict:
    """One task's examples, every engine in turn: right answers (and, on chat tasks, repeating
    ones), seconds, three samples and the per-example hits for the paired bootstrap."""
    exs = [ex for _, ex in prompts]
    longest = max(len(main.encode(t)) for ex in exs for t in ex["targets"])
    budget = CHAT_TOKENS if chat else min(64, longest + 4)
    right = dict.fromkeys(engines, 0)
    repeating = dict.fromkeys(engines, 0)
    solo = dict.fromkeys(engines, 0)  # requests a dominant member ran alone (evidence.solo_member)
    seconds = dict.fromkeys(engines, 0.0)
    samples: dict[str, list] = {k: [] for k in engines}
    hits: dict[str, list[int]] = {k: [] for k in engines}  # per example, for the paired bootstrap
    outputs: dict[str, list[str]] = {k: [] for k in engines}  # per example: texts compared across runs
    for prompt, ex in prompts:
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
            solo[key] += "solo" in res.stats
            right[key] += ok
            hits[key].append(int(ok))
            outputs[key].append(out)
            if len(samples[key]) < 3:
                samples[key].append({"input": ex["input"], "output": out.strip(), "correct": ok})
            bar.update()
            bar.set_postfix_str(f"{task}: {key}")
    return {
        "examples": len(exs),
        "max_new_tokens": budget,
        "chat": chat,
        "accuracy": {k: v / max(1, len(exs)) for k, v in right.items()},
        "correct": right,
        "repeating": repeating if chat else None,
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "solo": solo,
        "samples": samples,
        "hits": hits,
        "outputs": outputs,
    }


def _method_row(spec: MethodSpec, eng: Ensemble, s: dict, quality: dict, results: dict) -> dict[str, Any]:
    """One method's figures: speed, forwards, memory, accuracy per task and pooled, its own."""
    per_tok = s["time"] / max(1, s["tokens"])
    row: dict[str, Any] = {
        "method": spec.method,
        "config": spec.config,
        "members": 1 if spec.method == "single" else len(eng.members),
        "time_per_token_s": per_tok,
        "tokens": s["tokens"],
        "time_to_first_chunk_s": statistics.median(s["ttfc"]) if s["ttfc"] else None,
        "forward_passes_per_token": {n: v / max(1, s["tokens"]) for n, v in s["fwd"].items()},
        "bytes_per_s": s["bytes"] / s["time"] if s["time"] else None,
        "forward_passes_per_byte": {n: v / max(1, s["bytes"]) for n, v in s["fwd"].items()},
        "peak_memory_mb": round(s["peak"] / 2**20, 1),
        "accuracy": {t: q["accuracy"][spec.label] for t, q in quality.items()},
        "correct": {t: q["correct"][spec.label] for t, q in quality.items()},
        "repeating": {t: q["repeating"][spec.label] for t, q in quality.items() if q["chat"]},
        "task_seconds": {t: q["seconds"][spec.label] for t, q in quality.items()},
        "solo_requests": {t: q["solo"][spec.label] for t, q in quality.items() if q["solo"][spec.label]},
        "speed_seconds": round(s["time"], 2),
    }
    if quality:
        row["pooled_accuracy"] = pooled(row["accuracy"], results["examples_per_task"])
    row.update(_method_figures(spec.method, s["extra"]))
    if spec.method != "single" and len(eng.members) > 1:
        names = [m.name for m in eng.members]
        row["weights_by_kind"] = {}
        for kind in ("chat", "raw"):
            w, main = eng.member_weights(kind)
            row["weights_by_kind"][kind] = {"weights": dict(zip(names, [round(x, 4) for x in w])), "main": names[main]}
    return row


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


def _method_figures(method: str, stats: list) -> dict[str, Any]:
    """The method's own figures over the speed runs, as the method summarizes them."""
    return get_method(method).stats_class.summarize(stats) if stats else {}
