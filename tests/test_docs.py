"""The way in: README.md is one screen with both commands (and .ci/run runs command 2), every
Python snippet in it runs on the real bundled models, and the benchmark pages of the docs site
are what benchmarks/docs_pages.py writes from the committed results."""

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
    commands = [b.strip() for b in _blocks(README, "bash") if b.strip().startswith("python -m pip install")]
    assert len(commands) == 2 and "ensemble-llm generate" in commands[0] and "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("i", range(3))
def test_readme_python_snippets_run(i):
    snippets = _blocks(README, "python")
    assert len(snippets) == 3
    out = subprocess.run([sys.executable, "-c", snippets[i]], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip(), "the snippet printed no answer"


def test_benchmark_pages_are_written_from_the_committed_results():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import docs_pages

    assert (ROOT / "docs" / "index.md").read_text() == docs_pages.index_page(), "run python benchmarks/docs_pages.py"
    assert (ROOT / "docs" / "cli.md").read_text() == docs_pages.cli_page(), "run python benchmarks/docs_pages.py"
    for name in docs_pages.STUDIES:
        assert (ROOT / "docs" / "benchmarks" / f"{name}.md").read_text() == docs_pages.page(name), (
            f"docs/benchmarks/{name}.md is stale: run python benchmarks/docs_pages.py"
        )
