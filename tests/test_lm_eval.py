"""The field's own harness against a real `ensemble-llm serve`: lm-evaluation-harness's
`local-completions` model, on task files built here (no hub), runs a multiple-choice task
(log-likelihoods: token-id prompts, `echo`, `logprobs`) and a generative one, and its figures equal
the ones computed here with the engine directly on the same members."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

from ensemble_llm import Ensemble  # noqa: E402
from ensemble_llm.scoring import Scoring  # noqa: E402

METHOD = "specfuse"
MC = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Lyon", "Nice"], "label": 0},
    {"question": "How many legs has a cat?", "choices": ["two", "four", "six"], "label": 1},
    {"question": "What colour is the sky?", "choices": ["green", "red", "blue"], "label": 2},
]
GEN = [{"question": "What is 2 + 2?", "answer": "4"}, {"question": "Say yes.", "answer": "yes"}]
MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
"""
GEN_YAML = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, rows, yaml in (("mc", MC, MC_YAML), ("gen", GEN, GEN_YAML)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(yaml.format(data=data))
    return str(root)


@pytest.fixture(scope="module")
def direct(tiny_dirs):
    with Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method=METHOD) as eng:
        yield eng


@pytest.fixture(scope="module")
def harness(tiny_dirs, tasks, direct, tmp_path_factory, monkeypatch_module):
    from helpers import start_server
    from lm_eval.tasks import TaskManager

    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
    main = direct.member_weights("raw")[1]  # token-id prompts are read in this member's tokenizer
    tokenizer = (tiny_dirs["smol"], tiny_dirs["gemma"])[main]
    proc, base = start_server([tiny_dirs["smol"], tiny_dirs["gemma"]], METHOD)
    try:
        args = {
            "model": "ensemble",
            "base_url": base + "/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": tokenizer,
            "tokenized_requests": True,
        }
        yield lm_eval.simple_evaluate(
            model="local-completions",
            model_args=args,
            tasks=["tiny_mc", "tiny_gen"],
            task_manager=TaskManager(include_path=tasks),
            batch_size=1,
            log_samples=True,
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def loglikelihood(engine, context: str, continuation: str) -> float:
    """What the harness asks for, computed here: the prompt and continuation as the main member's
    token ids (the harness's own split), scored after the first token, the context's tokens left out."""
    member = engine.members[engine.member_weights("raw")[1]]
    ctx = member.encode(context)
    ids = member.encode(context + continuation)
    head = member.vocab_bytes[ids[0]].decode()
    text = context + continuation
    res = asyncio.run(engine.ascore(head, Scoring((text[len(head) :],), weigh=text, token_ids=(tuple(ids[1:]),))))
    return sum(t.logprob for t in res.scores[0].tokens[len(ctx) - 1 :])


def test_multiple_choice_through_the_harness_equals_the_direct_figures(harness, direct):
    samples = harness["samples"]["tiny_mc"]
    assert len(samples) == len(MC)
    right = 0
    for s in samples:
        doc = s["doc"]
        context = f"Q: {doc['question']}\nA:"
        lls = [ll for ((ll, _),) in s["resps"]]
        want = [loglikelihood(direct, context, " " + c) for c in doc["choices"]]
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(lls, want)), (lls, want)
        right += max(range(len(want)), key=want.__getitem__) == doc["label"]
    assert math.isclose(harness["results"]["tiny_mc"]["acc,none"], right / len(MC))


def test_generation_through_the_harness_equals_the_direct_replies(harness, direct):
    samples = harness["samples"]["tiny_gen"]
    for s in samples:
        prompt = f"Q: {s['doc']['question']}\nA:"
        mine = direct.generate(prompt, raw=True, max_new_tokens=6, temperature=0, stop=["\n"]).text
        assert s["resps"][0][0] == mine
    exact = sum(s["filtered_resps"][0] == s["doc"]["answer"] for s in samples) / len(samples)
    assert math.isclose(harness["results"]["tiny_gen"]["exact_match,none"], exact)
