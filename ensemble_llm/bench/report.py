"""The bench's report (floor 5): results.md (the methods' table and the comparison with the
members alone), the plots, and results.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .stats import pooled


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
        lines.append("| " + " | ".join(_row_cells(label, r, results, tasks)) + " |")
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


def _row_cells(label: str, r: dict, results: dict, tasks: list[str]) -> list[str]:
    """One method's row of the table: speed and forwards, accuracy per task, its own figures."""
    fwd = ", ".join(f"{v:.2f}" for v in r["forward_passes_per_token"].values())
    figs = []
    for kind, wk in r.get("weights_by_kind", {}).items():
        figs.append(f"{kind} w " + "/".join(f"{w:.2f}" for w in wk["weights"].values()) + f" (main {wk['main']})")
    if r.get("solo_requests"):  # requests a dominant member ran alone (evidence.solo_member)
        total = sum(results["examples_per_task"].get(t, 0) for t in tasks)
        figs.append(f"solo {sum(r['solo_requests'].values())}/{total}")
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
    return cells


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
