"""The bench's tasks (floor 5): the bundled dev suite and chat set, task files in the BIG-bench
format, the few-shot prompt of a task, and how an answer is scored."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Sequence

from ..errors import ConfigError

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
    shots = shot_text([(x["input"], x["targets"][0]) for x in lines[:3]])
    name = Path(path).stem.removesuffix("_dev")
    if name in INSTRUCTIONS and Path(path) == bundled_task(name):
        shots = INSTRUCTIONS[name] + "\n\n" + shots
    elif isinstance(lines[0].get("prefix"), str) and lines[0]["prefix"].strip():
        shots = lines[0]["prefix"].strip() + "\n\n" + shots  # the task's own instruction (BIG-bench's task_prefix)
    return shots, lines[3 : 3 + n]


SHOT_READINGS = ("fixed", "drawn")


def shot_text(pairs: Sequence[tuple[str, str]]) -> str:
    return "".join(f"Q: {q.strip()}\nA: {a}\n" for q, a in pairs)


def task_prompts(path: Path, n: int, shots: str = "fixed") -> list[tuple[str, dict]]:
    """(prompt, example) for the task's scored examples: "fixed", every example after the task's
    three first lines (`load_task`); "drawn", after three shots drawn for that example (its
    `shots` field, written by benchmarks/bigbench_split.py). Chat tasks: the input alone."""
    if shots not in SHOT_READINGS:
        raise ConfigError(f"shots must be one of {SHOT_READINGS}, got {shots!r}")
    head, exs = load_task(path, n)
    if is_chat_task(path):
        return [(ex["input"], ex) for ex in exs]
    if shots == "fixed":
        return [(head + f"Q: {ex['input'].strip()}\nA:", ex) for ex in exs]
    out = []
    for i, ex in enumerate(exs):
        drawn = ex.get("shots")
        if not isinstance(drawn, list) or not drawn:
            raise ConfigError(
                f"task file {path}, example {i + 1}: no drawn shots; --shots drawn needs task files "
                "written by benchmarks/bigbench_split.py (or use --shots fixed)"
            )
        prefix = ex["prefix"].strip() + "\n\n" if isinstance(ex.get("prefix"), str) and ex["prefix"].strip() else ""
        text = prefix + shot_text([(s["input"], s["target"]) for s in drawn])
        out.append((text + f"Q: {ex['input'].strip()}\nA:", ex))
    return out
