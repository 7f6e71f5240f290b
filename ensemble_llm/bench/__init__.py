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

from .report import comparison_markdown, markdown, plots, write
from .run import SPEED_PROMPTS, PeakMemory, add_main_ratios, run_bench
from .specs import DEFAULT_METHODS, MethodSpec, parse_methods
from .stats import BOOTSTRAP, bootstrap_diff, compare_to_members, pooled
from .tasks import (
    BUNDLED_TASKS,
    CHAT_TOKENS,
    DEFAULT_TASKS,
    INSTRUCTIONS,
    SUITE,
    bundled_task,
    contains_answer,
    is_chat_task,
    load_task,
    norm,
    repeats,
    resolve_task,
    resolve_tasks,
    task_prompts,
)

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
