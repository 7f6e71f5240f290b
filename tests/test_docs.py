"""The way in: README.md is one screen with both commands (and .ci/run runs command 2), every
Python snippet in it runs on the real bundled models, and the benchmark pages of the docs site
are what benchmarks/docs_pages.py writes from the committed results."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_readme_is_one_screen_and_ci_runs_its_second_command():
    assert len(README.splitlines()) <= 150
    commands = [b.strip() for b in _blocks(README, "bash") if "python -m pip install" in b.splitlines()[0]]
    assert len(commands) == 2 and "ensemble-llm generate" in commands[0] and "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


DOCS = ROOT / "docs"
SERVED = "127.0.0.1:8000"  # the address the serving page's client snippet talks to
# A block after this marker is compiled but not run; the marker says what it needs that the
# tests do not have (hub models, several GPUs, a cluster).
SNIPPET = re.compile(r"(<!-- compile only: [^>]+ -->\n)?```python\n(.*?)```", flags=re.S)


def snippets() -> list[tuple[str, str, bool]]:
    """(name, code, runs) for every Python block of README.md and of the docs pages; docs/index.md
    is README.md (checked below)."""
    pages = [ROOT / "README.md"] + [p for p in sorted(DOCS.rglob("*.md")) if p != DOCS / "index.md"]
    found = []
    for page in pages:
        for i, m in enumerate(SNIPPET.finditer(page.read_text())):
            found.append((f"{page.relative_to(ROOT)}#{i}", m.group(2), m.group(1) is None))
    return found


SNIPPETS = snippets()
RUNNER = """
import contextlib, io, json, sys, traceback
results = {}
for name, code in json.load(open(sys.argv[1])):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
        results[name] = {"stdout": out.getvalue(), "error": None}
    except BaseException:
        results[name] = {"stdout": out.getvalue(), "error": traceback.format_exc()[-3000:]}
json.dump(results, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def snippet_runs(tmp_path_factory):
    """Every runnable snippet, run in one fresh process (one import of torch and the libraries,
    each snippet with its own globals), with a real `ensemble-llm serve` behind the client one."""
    from helpers import start_server

    folder = tmp_path_factory.mktemp("snippets")
    server, base = start_server(["smollm2-135m-instruct", "gemma-3-270m"], "safe", api_key="KEY")
    try:
        port = base.rsplit(":", 1)[1]
        runnable = [(name, code.replace(SERVED, f"127.0.0.1:{port}")) for name, code, runs in SNIPPETS if runs]
        (folder / "in.json").write_text(json.dumps(runnable))
        done = subprocess.run(
            [sys.executable, "-c", RUNNER, str(folder / "in.json"), str(folder / "out.json")],
            capture_output=True,
            text=True,
            timeout=2400,
            cwd=folder,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((folder / "out.json").read_text())
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_readme_has_the_three_snippets_and_the_docs_say_which_do_not_run():
    assert [name for name, _, _ in SNIPPETS if name.startswith("README")] == [f"README.md#{i}" for i in range(3)]
    assert all(runs for name, _, runs in SNIPPETS if name.startswith("README"))
    assert sum(not runs for _, _, runs in SNIPPETS) <= 4, "compile-only snippets are for what CI cannot have"


@pytest.mark.real
@pytest.mark.server
# the first test sets up every snippet's run; on a machine without a cached llama-server, the
# members-on-a-server snippet builds one from the llama-cpp-python sdist first (once a machine)
@pytest.mark.timeout(2700)
@pytest.mark.parametrize("name", [name for name, _, runs in SNIPPETS if runs])
def test_snippet_runs(snippet_runs, name):
    run = snippet_runs[name]
    assert run["error"] is None, run["error"]
    assert run["stdout"].strip(), "the snippet printed nothing"


@pytest.mark.parametrize("name", [name for name, _, runs in SNIPPETS if not runs])
def test_compile_only_snippet_compiles(name):
    code = next(code for n, code, _ in SNIPPETS if n == name)
    compile(code, name, "exec")
    assert "from ensemble_llm import" in code, "a snippet shows its imports"


def test_benchmark_pages_are_written_from_the_committed_results():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import docs_pages

    assert (ROOT / "docs" / "index.md").read_text() == docs_pages.index_page(), "run python benchmarks/docs_pages.py"
    assert (ROOT / "docs" / "cli.md").read_text() == docs_pages.cli_page(), "run python benchmarks/docs_pages.py"
    for name in docs_pages.STUDIES:
        assert (ROOT / "docs" / "benchmarks" / f"{name}.md").read_text() == docs_pages.page(name), (
            f"docs/benchmarks/{name}.md is stale: run python benchmarks/docs_pages.py"
        )
