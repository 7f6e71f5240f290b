"""The field's own harness against a real `ensemble-llm serve`, as the docs run it: lm-evaluation-
harness's `local-completions` model with `tokenizer_backend=remote` (no tokenizer folder: the
server's /tokenizer_info, /tokenize and /detokenize), batches of prompts, on task files built here
(no hub). A few-shot multiple-choice task (log-likelihoods: token-id prompts, `echo`, `logprobs`)
equals `Ensemble.score(context, choices)` run here on the same members, and a generative task
equals the engine's own replies."""

from __future__ import annotations

import json
import math

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

from ensemble_llm import Ensemble  # noqa: E402

METHOD = "specfuse"
MC = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Lyon", "Nice"], "label": 0},
    {"question": "How many legs has a cat?", "choices": ["two", "four", "six"], "label": 1},
    {"question": "What colour is the sky?", "choices": ["green", "red", "blue"], "label": 2},
]
GEN = [{"question": "What is 2 + 2?", "answer": "4"}, {"question": "Say yes.", "answer": "yes"}]
SHOTS = "Q: What is the capital of Spain?\\nA: Madrid\\n\\nQ: How many legs has a bird?\\nA: two\\n\\n"
MC_YAML = """task: tiny_mc
description: "{shots}"
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
        (root / f"{name}.yaml").write_text(yaml.format(data=data, shots=SHOTS))
    return str(root)


@pytest.fixture(scope="module")
def direct(tiny_dirs):
    with Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method=METHOD) as eng:
        yield eng


def evaluate(models: list[str], method: str, tasks: str, names: list[str]) -> dict:
    """lm-eval's run, as the docs give it, against a real server of `models`."""
    from helpers import start_server
    from lm_eval.tasks import TaskManager

    proc, base = start_server(models, method)
    try:
        args = {"model": "ensemble", "base_url": base + "/v1/completions", "tokenizer_backend": "remote"}
        return lm_eval.simple_evaluate(
            model="local-completions",
            model_args=args,
            tasks=names,
            task_manager=TaskManager(include_path=tasks),
            batch_size=4,
            log_samples=True,
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def offline(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))


@pytest.fixture(scope="module")
def harness(tiny_dirs, tasks, direct, offline):
    return evaluate([tiny_dirs["smol"], tiny_dirs["gemma"]], METHOD, tasks, ["tiny_mc", "tiny_gen"])


def test_one_member_through_the_harness_is_its_own_token_log_likelihood(tiny_dirs, tasks, offline, tiny_members):
    """One member behind the server: the harness's figures are the member's own tokens'
    log-probabilities, computed here by a full forward of context and choice (the harness's own
    split: the whole text's tokens after the context's), as lm-eval's `hf` model computes them."""
    import torch

    out = evaluate([tiny_dirs["smol"]], "single", tasks, ["tiny_mc"])
    m = tiny_members["smol"]
    for s in out["samples"]["tiny_mc"]:
        for ((ll, _),), (ctx, cont) in zip(s["resps"], s["arguments"]):
            ids, whole = m.encode(ctx), m.encode(ctx + cont)
            lp = torch.log_softmax(m.forward_batch([whole])[0].double(), -1)
            want = sum(float(lp[j - 1, whole[j]]) for j in range(len(ids), len(whole)))
            assert math.isclose(ll, want, abs_tol=1e-4), (ctx[-20:], cont, ll, want)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_few_shot_multiple_choice_through_the_harness_equals_ensemble_score(harness, direct):
    samples = harness["samples"]["tiny_mc"]
    assert len(samples) == len(MC)
    right = 0
    for s in samples:
        doc, pairs = s["doc"], s["arguments"]  # the harness's own (context, continuation) per choice
        (context,) = {ctx for ctx, _ in pairs}
        assert context.startswith(SHOTS.replace("\\n", "\n")) and context.endswith(f"Q: {doc['question']}\nA:")
        lls = [ll for ((ll, _),) in s["resps"]]
        want = [w.logprob for w in direct.score(context, [cont for _, cont in pairs])]
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
