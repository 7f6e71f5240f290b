"""The house floor by floor: every `ensemble_llm` module sits on a floor and imports only from its
own floor or lower ones, lazy imports (inside functions) and annotation-only ones included, with
no circle anywhere; the HTTP client imports neither torch nor transformers. The floors are
CONTRIBUTING.md's Layout section."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "ensemble_llm"

# floor -> modules (dotted, without the "ensemble_llm." prefix; "members" is members/__init__.py)
FLOORS = {
    0: {"defaults", "errors", "results", "sharing", "stopping", "streams"},
    1: {
        "members",
        "members.registry",
        "members.fetch",
        "members.convert",
        "members.rows",
        "members.context",
        "members.steps",
        "members.scheduler",
        "members.vocab",
        "members.protocol",
        "members.prefix",
        "members.state",
        "members.view",
        "members.bytelm",
        "members.loader",
        "members.sources",
        "members.options",
        "members.hub",
        "members.stores",
        "members.backends",
        "members.backends.transformers",
        "members.backends.transformers.member",
        "members.backends.transformers.rowgroups",
        "members.backends.transformers.headpad",
        "members.backends.transformers.load",
        "members.backends.llama_cpp",
        "members.backends.llama_cpp.member",
        "members.backends.llama_cpp.runner",
        "members.backends.llama_cpp.health",
        "members.backends.llama_cpp.probe",
        "members.backends.llama_cpp.load",
        "members.backends.server",
        "members.backends.server.client",
        "members.backends.server.rows",
        "members.backends.server.member",
        "members.backends.server.load",
        "members.backends.server.build",
        "members.plan",
        "ray",
        "ray.actor",
        "ray.handles",
        "ray.member",
        "ray.placement",
    },
    2: {
        "constraints",
        "guide",
        "chat",
        "params",
        "evidence",
        "calibrate",
        "requests",
        "placement",
        "worker",
        "tools",
        "kvbudget",
    },
    3: {
        "methods",
        "methods.base",
        "methods.align",
        "methods.single",
        "methods.unite",
        "methods.safe",
        "methods.specfuse",
        "methods.smc",
        "methods.text",
        "methods.side",
        "methods.auto",
        "pipeline",
        "scoring",
        "token_scoring",
        "scores",
        "logprobs",
    },
    4: {"engine"},
    5: {
        "",
        "__main__",
        "serve",
        "serve_scoring",
        "serve_tokenizer",
        "serve_requests",
        "serve_http",
        "serve_stream",
        "client",
        "cli",
        "bench",
        "bench.tasks",
        "bench.specs",
        "bench.stats",
        "bench.run",
        "bench.report",
        "bench.constraints",
    },
}
FLOOR = {m: f for f, ms in FLOORS.items() for m in ms}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, annotations: bool = False) -> set[str]:
    """The ensemble_llm modules a file imports anywhere in its body (annotation-only imports under
    `if TYPE_CHECKING:` only with `annotations`), resolved to the modules in FLOOR."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def resolve(mod: str) -> str | None:  # the longest known module that `mod` names
        while mod not in FLOOR and "." in mod:
            mod = mod.rpartition(".")[0]
        return mod if mod in FLOOR else None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node) and not annotations:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "ensemble_llm" or node.module.startswith("ensemble_llm.")):
                mod = node.module.removeprefix("ensemble_llm").lstrip(".")
            else:
                mod = None
            if mod is not None:
                for alias in node.names:  # `from . import x` may name a submodule
                    target = resolve(f"{mod}.{alias.name}" if f"{mod}.{alias.name}".lstrip(".") in FLOOR else mod)
                    if target is not None:
                        out.add(target.lstrip("."))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ensemble_llm"):
                    target = resolve(alias.name.removeprefix("ensemble_llm").lstrip("."))
                    if target is not None:
                        out.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    out.discard(name)
    return out


def graph(annotations: bool = False) -> dict[str, set[str]]:
    return {module_name(p): imports_of(p, annotations) for p in sorted(ROOT.rglob("*.py"))}


def test_every_module_has_a_floor():
    missing = sorted(set(graph()) - set(FLOOR))
    gone = sorted(set(FLOOR) - set(graph()))
    assert not missing, f"modules without a floor (add them to FLOORS and the README's layout): {missing}"
    assert not gone, f"FLOORS names modules that no longer exist: {gone}"


def test_no_import_reaches_up_a_floor():
    up = [
        f"{a or 'ensemble_llm'} (floor {FLOOR.get(a)}) imports {b} (floor {FLOOR.get(b)})"
        for a, deps in graph(annotations=True).items()
        for b in deps
        if FLOOR.get(b, 99) > FLOOR.get(a, -1)
    ]
    assert not up, "\n".join(up)


def test_no_import_circle():
    """Annotation-only imports count: a lower module names what it needs of an upper one as a
    Protocol of its own (members/context.py's `Steps`, pipeline.py's `EngineView`)."""
    g = graph(annotations=True)
    state: dict[str, int] = {}
    path: list[str] = []

    def walk(a: str) -> list[str] | None:
        state[a] = 1
        path.append(a)
        for b in sorted(g.get(a, ())):
            if state.get(b) == 1:
                return path[path.index(b) :] + [b]
            if b not in state:
                found = walk(b)
                if found:
                    return found
        state[a] = 2
        path.pop()
        return None

    for a in sorted(g):
        if a not in state:
            circle = walk(a)
            assert circle is None, "import circle: " + " -> ".join(circle)


def test_checker_sees_lazy_and_relative_imports(tmp_path):
    """The checker is not blind: a lazy relative import inside a function is found and resolved."""
    deps = imports_of(ROOT / "cli.py")
    assert {"bench", "serve", "members.fetch"} <= deps  # cli imports these inside its commands
    assert "members.plan" in imports_of(ROOT / "members" / "backends" / "transformers" / "load.py")
    # serve_stream names the engine for its annotations only
    assert "engine" not in imports_of(ROOT / "serve_stream.py")
    assert "engine" in imports_of(ROOT / "serve_stream.py", annotations=True)


@pytest.mark.parametrize(
    "module", ["ensemble_llm.client", "ensemble_llm.errors", "ensemble_llm.results", "ensemble_llm.params"]
)
def test_light_modules_import_without_torch(module):
    code = (
        f"import sys, {module}\n"
        "heavy = [m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


MAX_FUNCTION_LINES = 60  # a function a reader takes in at once (the redesign's rule)
MAX_ENGINE_LINES = 300  # the engine stays a thin owner of members, method and queue
MAX_SERVE_LINES = 400  # serve.py: the app and its routes; the other concerns have serve_*.py


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{module_name(path)}.{node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (cut them into named steps): {long}"


# functions that take more than MAX_PARAMETERS: keyword-only settings a user passes by name, each
# documented where it is taken (the rest take a settings object: LoadRequest, Prompted, Reply, ...)
MAX_PARAMETERS = 8
MANY_SETTINGS = {
    "engine.__init__",  # Ensemble(...): the public constructor
    "members.loader.load_member",  # public: a member's device, dtype, options, context
    "methods.smc.smc_sample",  # the sampler's settings, tested apart (tests/test_smc.py)
    "bench.run.run_bench",  # `ensemble-llm bench`'s flags
    "bench.constraints.run_constraint_bench",  # `ensemble-llm bench-constraints`' flags
}


def test_no_function_takes_more_than_eight_parameters():
    many = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                key = f"{module_name(path)}.{node.name}"
                if n > MAX_PARAMETERS and key not in MANY_SETTINGS:
                    many.append(f"{key}: {n}")
                if key in MANY_SETTINGS and len(a.posonlyargs + a.args) > MAX_PARAMETERS:
                    many.append(f"{key}: its settings must be keyword-only")
    assert not many, f"functions over {MAX_PARAMETERS} parameters (group them in a settings object): {many}"


def test_the_engine_and_the_server_stay_thin():
    n = len((ROOT / "engine.py").read_text(encoding="utf-8").splitlines())
    assert n < MAX_ENGINE_LINES, f"engine.py has {n} lines; move a job out of it (see the README's layout)"
    n = len((ROOT / "serve.py").read_text(encoding="utf-8").splitlines())
    assert n < MAX_SERVE_LINES, f"serve.py has {n} lines; move a concern to serve_*.py (requests, stream, scoring)"


def test_a_backend_is_its_folder_and_a_registry_entry():
    """Each backend in the registry is a folder `members/backends/<name>/` whose loader and
    `accepts` the registry names, whose member is a `StateMember`, and which nothing outside it
    imports: adding a backend touches its folder and one entry in members/backends/__init__.py.
    (members/__init__.py re-exports transformers' `Member`, the class a custom member subclasses.)"""
    from ensemble_llm.members.backends import BACKENDS, accepts_of, loader_of
    from ensemble_llm.members.state import StateMember

    folders = {p.name for p in (ROOT / "members" / "backends").iterdir() if p.is_dir() and p.name != "__pycache__"}
    named = {b.loader.split(".")[0] for b in BACKENDS.values()}
    assert folders == named, f"backend folders {sorted(folders)} are not the registry's {sorted(named)}"
    for name, backend in BACKENDS.items():
        folder = backend.loader.split(".")[0]
        assert backend.accepts.split(".")[0] == folder, f"{name}: its accepts lives outside its folder"
        assert callable(loader_of(name)) and callable(accepts_of(name))
        member = importlib.import_module(f"ensemble_llm.members.backends.{folder}.member")
        classes = [c for c in vars(member).values() if isinstance(c, type) and c.__module__ == member.__name__]
        assert any(issubclass(c, StateMember) for c in classes), f"{name}: no StateMember in its member.py"
    reexport = {"members": {"members.backends.transformers.member"}}
    bad = sorted(
        f"{m} imports {d}"
        for m, deps in graph(annotations=True).items()
        for d in deps
        if d.startswith("members.backends.")
        and not m.startswith(".".join(d.split(".")[:3]))
        and d not in reexport.get(m, ())
    )
    assert not bad, f"modules outside a backend's folder import it: {bad}"


def test_no_state_api_block_is_written_twice():
    """The state API exists once (members/state.py): no six code lines in a row repeat between
    the members' modules."""
    files = [ROOT / "members" / "state.py", ROOT / "ray" / "member.py"]
    files += sorted((ROOT / "members" / "backends").glob("*/member.py"))
    where: dict[tuple[str, ...], set[str]] = {}
    for path in files:
        lines = [x.strip() for x in path.read_text(encoding="utf-8").splitlines()]
        code = [x for x in lines if x and not x.startswith(("#", '"""'))]
        for i in range(len(code) - 5):
            where.setdefault(tuple(code[i : i + 6]), set()).add(str(path.relative_to(ROOT)))
    repeats = [f"{sorted(fs)}: {block[0]}" for block, fs in where.items() if len(fs) > 1]
    assert not repeats, repeats[:5]


def test_no_backend_name_is_compared_outside_the_registry():
    """A backend is its folder and a registry entry: code elsewhere asks the registry or the member
    (`backend`, `numerics`, `capabilities`), never compares a backend's name."""
    from ensemble_llm.members.backends import BACKENDS

    names = "|".join(re.escape(n) for n in BACKENDS)
    compared = re.compile(rf'(==|!=)\s*"({names})"|"({names})"\s*(==|!=)|\bbackend\s*(==|!=)\s')
    allowed = {"members/backends/__init__.py"}  # the registry
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted(ROOT.rglob("*.py"))
        if path.relative_to(ROOT).as_posix() not in allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if compared.search(line)
    ]
    assert not hits, "ask members/backends/ or the member instead:\n" + "\n".join(hits)
