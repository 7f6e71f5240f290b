"""`ensemble-llm bench` (floor 5, a package): speed, cost and quality of every method side by side,
in one run.

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

Modules: tasks.py (the suite, task files, prompts, scoring), specs.py (`--methods` items),
run.py (`run_bench`), stats.py (pooled accuracy, paired bootstrap), report.py (results.md, plots,
results.json), constraints.py (`ensemble-llm bench-constraints`).
"""

# the names load on first use (PEP 562), as the package's own do: the CLI reads the defaults
# here (tasks.py, specs.py) without importing torch, so `ensemble-llm --help` stays fast
_WHERE = {
    "BOOTSTRAP": "stats",
    "BUNDLED_TASKS": "tasks",
    "CHAT_TOKENS": "tasks",
    "DEFAULT_METHODS": "specs",
    "DEFAULT_TASKS": "tasks",
    "INSTRUCTIONS": "tasks",
    "MethodSpec": "specs",
    "PeakMemory": "run",
    "SPEED_PROMPTS": "run",
    "SUITE": "tasks",
    "add_main_ratios": "run",
    "bootstrap_diff": "stats",
    "bundled_task": "tasks",
    "compare_to_members": "stats",
    "comparison_markdown": "report",
    "contains_answer": "tasks",
    "is_chat_task": "tasks",
    "load_task": "tasks",
    "markdown": "report",
    "norm": "tasks",
    "parse_methods": "specs",
    "plots": "report",
    "pooled": "stats",
    "repeats": "tasks",
    "resolve_task": "tasks",
    "resolve_tasks": "tasks",
    "run_bench": "run",
    "task_prompts": "tasks",
    "write": "report",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)


__all__ = [
    "BOOTSTRAP",
    "BUNDLED_TASKS",
    "CHAT_TOKENS",
    "DEFAULT_METHODS",
    "DEFAULT_TASKS",
    "INSTRUCTIONS",
    "SPEED_PROMPTS",
    "SUITE",
    "MethodSpec",
    "PeakMemory",
    "add_main_ratios",
    "bootstrap_diff",
    "bundled_task",
    "compare_to_members",
    "comparison_markdown",
    "contains_answer",
    "is_chat_task",
    "load_task",
    "markdown",
    "norm",
    "parse_methods",
    "plots",
    "pooled",
    "repeats",
    "resolve_task",
    "resolve_tasks",
    "run_bench",
    "task_prompts",
    "write",
]
