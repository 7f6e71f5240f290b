"""One set of defaults (ensemble_llm/defaults.py): the engine, the CLI, serve and both facades
read the same method, budget and sampling settings, and the facades build the same
GenerationParams from the same call."""

import pytest

from ensemble_llm import Ensemble, GenerationParams, defaults
from ensemble_llm.cli import build_parser
from ensemble_llm.members.registry import DEFAULT_MODELS


def test_engine_cli_serve_and_facades_share_the_defaults(tiny_dirs):
    from langchain_ensemble_llm import EnsembleLLM as LangChainLLM
    from llama_index.llms.ensemble_llm import EnsembleLLM as LlamaIndexLLM

    from ensemble_llm.serve_requests import ChatBody, params_of

    want = (defaults.MAX_NEW_TOKENS, defaults.TEMPERATURE, defaults.TOP_P)
    p = GenerationParams()
    assert (p.max_new_tokens, p.temperature, p.top_p) == want
    args = build_parser().parse_args(["generate", "hi"])
    assert (args.max_new_tokens, args.temperature, args.method) == (want[0], want[1], None)
    served = params_of(ChatBody.model_validate({"messages": [{"role": "user", "content": "hi"}]}), raw=False)
    assert served == p
    lc = LangChainLLM(members=[tiny_dirs["smol"], tiny_dirs["gemma"]])
    li = LlamaIndexLLM(members=[tiny_dirs["smol"], tiny_dirs["gemma"]])
    assert (lc.max_tokens, lc.temperature, lc.top_p) == want
    assert (li.max_new_tokens, li.temperature, li.top_p) == want
    # the method: the ensemble default for 2+ members, single for one, everywhere
    assert Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]]).method_name == defaults.ENSEMBLE_METHOD
    assert Ensemble([tiny_dirs["smol"]]).method_name == "single"
    assert tuple(Ensemble().model_names) == DEFAULT_MODELS
    assert lc.engine.method_name == li.engine.method_name == defaults.ENSEMBLE_METHOD


@pytest.mark.parametrize(
    "call",
    [
        {},
        {"max_tokens": 7},
        {"max_new_tokens": 9, "max_tokens": 7},
        {"temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["\n", "Q:"]},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    ],
)
def test_both_facades_build_the_same_params_from_the_same_call(tiny_dirs, call):
    from langchain_ensemble_llm import EnsembleLLM as LangChainLLM
    from llama_index.llms.ensemble_llm import EnsembleLLM as LlamaIndexLLM

    members = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    lc = LangChainLLM(members=members, stop=["END"], seed=1)
    li = LlamaIndexLLM(members=members, stop=["END"], seed=1)
    a = lc._request(call.get("stop"), {k: v for k, v in call.items() if k != "stop"})
    b = li._request(dict(call))
    assert a == b
    assert a.max_new_tokens == call.get("max_new_tokens", call.get("max_tokens", defaults.MAX_NEW_TOKENS))


def test_cli_generate_with_one_member_runs_single(tiny_dirs, capsys):
    from ensemble_llm.cli import main

    assert main(["generate", "Say hi.", "--models", str(tiny_dirs["smol"]), "--max-new-tokens", "3", "-v"]) == 0
    out = capsys.readouterr()
    assert "[ensemble-llm] single over" in out.err


def test_cli_generate_prints_only_the_answer_by_default(tiny_dirs):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "ensemble_llm", "generate", "Hi", "--models", str(tiny_dirs["smol"])]
    out = subprocess.run([*cmd, "--max-new-tokens", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout  # (the tiny random model answers with whitespace)
    assert out.stderr == ""  # no status lines, warnings or loading bars without -v


def test_cli_generate_takes_member_dicts_method_config_system_and_stops(tiny_dirs, capsys):
    import json

    from ensemble_llm.cli import main

    members = json.dumps([{"model": str(tiny_dirs["smol"]), "backend": "transformers"}, str(tiny_dirs["gemma"])])
    argv = ["generate", "Say hi.", "--models", members, "--method", "unite", "--max-new-tokens", "4", "--stats"]
    argv += ["--method-config", '{"weights": null}', "--system", "Be brief.", "--stop", "\n", "--top-p", "0.9"]
    assert main([*argv, "--no-stream"]) == 0
    err = capsys.readouterr().err
    stats = json.loads(err[err.index("{") :])
    assert list(stats["stats"]["member_weights"].values()) == [0.5, 0.5]  # the config's uniform weights
    assert stats["usage"]["completion_tokens"] <= 4
    assert main(["generate", "hi", "--models", "[", "--max-new-tokens", "2"]) == 2
    assert "--models is not valid JSON" in capsys.readouterr().err
    assert main(["generate", "hi", "--method-config", "[1]"]) == 2
    assert "--method-config must be a JSON object" in capsys.readouterr().err


def test_cli_logprobs_prints_the_ensembles_figures(tiny_dirs, capsys):
    from ensemble_llm import Ensemble
    from ensemble_llm.cli import main

    members = f"{tiny_dirs['smol']},{tiny_dirs['gemma']}"
    argv = ["generate", "Say hi.", "--models", members, "--method", "safe", "--max-new-tokens", "4"]
    argv += ["--temperature", "0"]
    assert main([*argv, "--no-stream", "--logprobs", "2"]) == 0
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("token\tensemble\t")) :]  # after load bars
    assert lines[0].endswith("\talternatives")
    with Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method="safe") as eng:
        (want,) = eng.score("Say hi.", [out[:-1]], raw=False)  # print() added one newline
    assert len(lines) == 1 + len(want.tokens)
    for line, t in zip(lines[1:], want.tokens):
        assert line.split("\t")[:2] == [repr(t.token), f"{t.logprob:.3f}"]
    assert main([*argv, "--logprobs", "-1"]) == 2  # a bad K is the engine's clear error
    assert "top must be" in capsys.readouterr().err
