"""The benchmark harness: method specs, task files, one real (tiny-model) run with its files."""

from __future__ import annotations

import json

import pytest
import torch

from ensemble_llm import ConfigError
from ensemble_llm.bench import (
    BUNDLED_TASKS,
    INSTRUCTIONS,
    SUITE,
    bundled_task,
    load_task,
    markdown,
    norm,
    parse_methods,
    resolve_task,
    run_bench,
    task_prompts,
    write,
)
from ensemble_llm.cli import main


def test_parse_methods():
    specs = parse_methods(["single", "safe", "smc:f=min,n_particles=4", "single:member=1"], n_members=2)
    assert [s.label for s in specs] == ["single-0", "single-1", "safe", "smc:f=min,n_particles=4", "single-1"]
    assert specs[3].config == {"f": "min", "n_particles": 4}
    with pytest.raises(ConfigError, match="unknown method"):
        parse_methods(["fancy"], 2)
    with pytest.raises(ConfigError, match="key=value"):
        parse_methods(["smc:min"], 2)


def test_own_task_file_gets_no_instruction(tmp_path):
    own = tmp_path / "plural_dev.jsonl"  # same name as a bundled task, but the user's file
    own.write_text(bundled_task("plural").read_text(encoding="utf-8"), encoding="utf-8")
    assert load_task(own, 2)[0].startswith("Q: ")


def test_drawn_shots_are_each_examples_own(tmp_path):
    """--shots drawn: every example after its own shots (bigbench_split.py's task files), the
    task's own prefix first; --shots fixed: the first three lines for all; a file without drawn
    shots is refused by name."""
    rows = [{"input": f"q{i}", "targets": [f"a{i}"], "prefix": "Do it."} for i in range(5)]
    rows[3]["shots"] = [{"input": "x", "target": "y"}, {"input": "z", "target": "w"}]
    rows[4]["shots"] = [{"input": "q0", "target": "a0"}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = task_prompts(path, 5, "drawn")
    assert [p for p, _ in drawn] == ["Do it.\n\nQ: x\nA: y\nQ: z\nA: w\nQ: q3\nA:", "Do it.\n\nQ: q0\nA: a0\nQ: q4\nA:"]
    fixed = task_prompts(path, 5, "fixed")
    assert fixed[1][0] == "Do it.\n\nQ: q0\nA: a0\nQ: q1\nA: a1\nQ: q2\nA: a2\nQ: q4\nA:"
    assert [ex["input"] for _, ex in drawn] == [ex["input"] for _, ex in fixed] == ["q3", "q4"]
    with pytest.raises(ConfigError, match="no drawn shots"):
        task_prompts(bundled_task("plural"), 2, "drawn")
    with pytest.raises(ConfigError, match="shots must be one of"):
        task_prompts(path, 2, "random")


def test_tasks_and_scoring():
    for name in BUNDLED_TASKS:
        shots, exs = load_task(bundled_task(name), 5)
        if name.startswith("chat"):  # chat tasks: questions sent as chat messages, no shots
            assert shots == "" and len(exs) == 5
            continue
        assert shots.count("Q: ") == 3 and len(exs) == 5 and all(ex["targets"] for ex in exs)
        assert shots.startswith(INSTRUCTIONS[name] + "\n\nQ: ")
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


@pytest.mark.slow
def test_run_writes_table_json_and_plots(tiny_dirs, tmp_path):
    models = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    specs = parse_methods(["single", "safe", "smc:n_particles=2"], 2)
    res = run_bench(
        models, specs, [resolve_task("qa_wikidata:2", 0)], speed_prompts=1, max_new_tokens=4, progress=False
    )
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
    main_table = table.split("## Against the members alone")[0]
    assert main_table.count("\n| ") == 5 and "smc:n_particles=2" in main_table
    cmp = res["comparison"]  # every ensemble against the members, from the same per-example hits
    assert set(cmp["methods"]) == {"safe", "smc:n_particles=2"} and cmp["tasks"] == ["qa_wikidata"]
    hits = res["hits"]["qa_wikidata"]
    best = cmp["best_single"]
    assert cmp["methods"]["safe"]["vs_best_single"]["diff"] == pytest.approx(
        100 * (sum(hits["safe"]) - sum(hits[best])) / 2, abs=0.01
    )
    assert "| safe | " in table.split("## Against the members alone")[1]


def test_bootstrap_interval_against_brute_force():
    import itertools

    import numpy as np

    from ensemble_llm.bench import bootstrap_diff, resolve_tasks

    a = {"t1": [1, 0, 1], "t2": [1, 1]}
    b = {"t1": [0, 0, 1], "t2": [0, 1]}
    got = bootstrap_diff(a, b, resamples=20000)
    # every equally likely stratified resample, enumerated: 3^3 draws of t1 times 2^2 of t2
    d1, d2 = np.array(a["t1"]) - np.array(b["t1"]), np.array(a["t2"]) - np.array(b["t2"])
    sums = sorted(
        100 * (d1[list(i)].sum() + d2[list(j)].sum()) / 5
        for i in itertools.product(range(3), repeat=3)
        for j in itertools.product(range(2), repeat=2)
    )
    assert got["diff"] == pytest.approx(40.0) and got["examples"] == 5
    assert got["low"] == pytest.approx(np.percentile(sums, 2.5), abs=20.0 / 5)
    assert got["high"] == pytest.approx(np.percentile(sums, 97.5), abs=20.0 / 5)
    same = bootstrap_diff(a, a)
    assert same == {"diff": 0.0, "low": 0.0, "high": 0.0, "examples": 5}
    suite = resolve_tasks(["suite:7", "qa_wikidata:2"], 20)
    assert [p.stem.removesuffix("_dev") for p, _ in suite][:7] == list(SUITE) and suite[0][1] == 7
    assert all(load_task(p, n)[1] for p, n in suite)


def test_cli_rejects_bad_arguments(capsys):
    assert main(["bench", "--methods", "fancy", "--no-tasks"]) == 2
    assert "unknown method" in capsys.readouterr().err
    assert main(["bench", "--tasks", "missing.jsonl"]) == 2
    assert "neither a bundled task" in capsys.readouterr().err
