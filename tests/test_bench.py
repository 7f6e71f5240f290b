"""The benchmark harness: method specs, task files, one real (tiny-model) run with its files."""

from __future__ import annotations

import json

import pytest
import torch

from ensemble_llm import ConfigError
from ensemble_llm.bench import (BUNDLED_TASKS, bundled_task, load_task, markdown, norm, parse_methods,
                                resolve_task, run_bench, write)
from ensemble_llm.cli import main


def test_parse_methods():
    specs = parse_methods(["single", "safe", "smc:f=min,n_particles=4", "single:member=1"], n_members=2)
    assert [s.label for s in specs] == ["single-0", "single-1", "safe", "smc:f=min,n_particles=4", "single-1"]
    assert specs[3].config == {"f": "min", "n_particles": 4}
    with pytest.raises(ConfigError, match="unknown method"):
        parse_methods(["fancy"], 2)
    with pytest.raises(ConfigError, match="key=value"):
        parse_methods(["smc:min"], 2)


def test_tasks_and_scoring():
    for name in BUNDLED_TASKS:
        shots, exs = load_task(bundled_task(name), 5)
        if name.startswith("chat"):  # chat tasks: questions sent as chat messages, no shots
            assert shots == "" and len(exs) == 5
            continue
        assert shots.count("Q: ") == 3 and len(exs) == 5 and all(ex["targets"] for ex in exs)
    assert resolve_task("qa_wikidata:7", 20) == (bundled_task("qa_wikidata"), 7)
    with pytest.raises(ConfigError, match="neither a bundled task"):
        resolve_task("nope:3", 20)
    assert norm(" Paris.\nQ: next") == "paris" and norm("") == ""


def test_bad_bench_arguments_are_named(tmp_path, tiny_dirs):
    specs = parse_methods(["single:member=0"], 2)
    with pytest.raises(ConfigError, match="speed_prompts"):
        run_bench([tiny_dirs["smol"]], specs, [], speed_prompts=21)
    with pytest.raises(ConfigError, match="nothing to run"):
        run_bench([tiny_dirs["smol"]], specs, [], speed_prompts=0)
    with pytest.raises(ConfigError, match="listed twice"):
        run_bench([tiny_dirs["smol"]], specs + specs, [], speed_prompts=1)
    with pytest.raises(ConfigError, match=">= 1"):
        resolve_task("qa_wikidata:0", 20)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a", "targets": ["b"]}\n' * 3 + '{"question": "c"}\n')
    with pytest.raises(ConfigError, match="BIG-bench jsonl format"):
        load_task(bad, 5)


def test_run_writes_table_json_and_plots(tiny_dirs, tmp_path):
    models = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    specs = parse_methods(["single", "safe", "smc:n_particles=2"], 2)
    res = run_bench(models, specs, [resolve_task("qa_wikidata:2", 0)], speed_prompts=1, max_new_tokens=4,
                    progress=False)
    rows = res["methods"]
    assert set(rows) == {"single-0", "single-1", "safe", "smc:n_particles=2"}
    assert rows["single-0"]["ratio_to_single_0"] == 1.0 and rows["single-0"]["members"] == 1
    assert rows["safe"]["members"] == 2 and "ensembled_fraction" in rows["safe"]
    assert rows["smc:n_particles=2"]["byte_steps"] >= 1  # greedy: the beam search over bytes
    assert res["devices"] == ["cuda:0" if torch.cuda.is_available() else "cpu"]
    assert all(0 <= r["accuracy"]["qa_wikidata"] <= 1 for r in rows.values())
    paths = write(res, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["examples_per_task"] == {"qa_wikidata": 2}
    for name in ("quality_vs_time.png", "time_vs_members.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and tmp_path / name in paths
    table = markdown(res)
    assert table.count("\n| ") == 5 and "smc:n_particles=2" in table


def test_cli_rejects_bad_arguments(capsys):
    assert main(["bench", "--methods", "fancy", "--no-tasks"]) == 2
    assert "unknown method" in capsys.readouterr().err
    assert main(["bench", "--tasks", "missing.jsonl"]) == 2
    assert "neither a bundled task" in capsys.readouterr().err
