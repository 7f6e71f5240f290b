"""`ensemble-llm`: generate | models list | models pull | models plan | bench | bench-constraints | serve."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time

from . import __version__, defaults

DEFAULT_PROMPT = "What is the capital of France?"


def member_specs(text: str | None) -> list | None:
    """--models: comma-separated names, or a JSON list of names and member dicts
    ('[{"model": "gemma-3-270m", "backend": "transformers"}]'); None: the default members."""
    from .errors import ConfigError

    if not text:
        return None
    text = text.strip()
    if not text.startswith("["):
        return text.split(",")
    try:
        members = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--models is not valid JSON ({exc}); pass names a,b or a JSON list of members") from None
    if not isinstance(members, list) or not members:
        raise ConfigError("--models as JSON must be a non-empty list of names or member dicts")
    return members


def method_config(text: str | None) -> dict | None:
    """--method-config: the method's options as a JSON object, e.g. '{"segment_len": 8}'."""
    from .errors import ConfigError

    if not text:
        return None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--method-config is not valid JSON ({exc}); pass e.g. '{{\"segment_len\": 8}}'") from None
    if not isinstance(cfg, dict):
        raise ConfigError("--method-config must be a JSON object of the method's options")
    return cfg


def _generate_request(args) -> tuple:
    """generate's prompt (with --system, a chat) and its settings."""
    prompt = args.prompt
    if args.system is not None:
        prompt = [{"role": "system", "content": args.system}, {"role": "user", "content": args.prompt}]
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    return prompt, {**kw, "raw": args.raw, "stop": tuple(args.stop)}


def _cmd_generate(args) -> int:
    from . import Ensemble, EnsembleError

    try:
        t0 = time.perf_counter()
        models, config = member_specs(args.models), method_config(args.method_config)
        place = _placement(args)
        engine = Ensemble(models, method=args.method, config=config, device=args.device, dtype=args.dtype, **place)
        prompt, kw = _generate_request(args)
        engine.check_request(prompt, **kw)  # a bad request fails here, before seconds of loading
        if args.verbose:
            print(f"[ensemble-llm] {engine.method_name} over {', '.join(engine.model_names)}", file=sys.stderr)
        engine.load()
        if args.verbose:
            print(f"[ensemble-llm] models ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        if args.stream:
            stream = engine.stream(prompt, **kw)
            for delta in stream:
                print(delta, end="", flush=True)
            print()
            result = stream.result
        else:
            result = engine.generate(prompt, **kw)
            print(result.text)
        if args.logprobs is not None:
            _print_logprobs(engine, prompt, result.text, args.logprobs, args.raw)
    except EnsembleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.stats:
        print(
            json.dumps(
                {"usage": result.usage.to_dict(), "finish_reason": result.finish_reason, "stats": result.stats},
                indent=2,
            ),
            file=sys.stderr,
        )
    return 0


def _print_logprobs(engine, prompt, text: str, top: int, raw: bool) -> None:
    """--logprobs: per token of the reply, the ensemble's log-probability, each member's and the
    `top` best alternatives (docs/scoring.md), one tab-separated line each on stderr."""
    from .logprobs import reply_logprobs

    content = reply_logprobs(engine, prompt, text, top=top, raw=raw)["content"]
    names = list(content[0]["members"]) if content else []
    print("token\tensemble\t" + "\t".join(names) + ("\talternatives" if top else ""), file=sys.stderr)
    for t in content:
        alts = ", ".join(f"{a['token']!r} {a['logprob']:.3f}" for a in t["top_logprobs"])
        own = "\t".join(f"{t['members'][n]:.3f}" for n in names)
        print(f"{t['token']!r}\t{t['logprob']:.3f}\t{own}" + (f"\t{alts}" if top else ""), file=sys.stderr)


def _add_placement(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--placement",
        choices=("local", "ray"),
        default="local",
        help="members in this process (local) or each in a Ray actor (ray)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="with --placement ray: the cluster ('auto', 'ray://HEAD:10001'); default: a local one",
    )
    p.add_argument(
        "--member-resources",
        default=None,
        metavar="JSON",
        help="with --placement ray: Ray resources per member, one object for all or a list, e.g. "
        '\'[{"num_gpus": 1}, {"num_gpus": 1}]\'',
    )


def _placement(args) -> dict:
    """The engine's placement keywords from the command line (bad JSON: an EnsembleError naming it)."""
    from .errors import ConfigError

    resources = None
    if args.member_resources is not None:
        try:
            resources = json.loads(args.member_resources)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--member-resources is not valid JSON ({exc}); pass e.g. '{{\"num_gpus\": 1}}'") from exc
    return {"placement": args.placement, "ray_address": args.ray_address, "member_resources": resources}


def _cmd_models_list(args) -> int:
    from .members import BUNDLED
    from .members.convert import is_converted
    from .members.fetch import cache_root

    root = cache_root()
    for name, m in BUNDLED.items():
        ready = "converted" if is_converted(root / "converted" / name) else "not fetched"
        default = " (default)" if m.default else ""
        print(f"{name:30s} {m.size_hint:>8s}  {ready:12s} {m.description}{default}")
    return 0


def _cmd_models_pull(args) -> int:
    from .errors import EnsembleError
    from .members import BUNDLED
    from .members.loader import local_dir, resolve_source

    names = args.names or [n for n, m in BUNDLED.items() if m.default]
    try:
        for name in names:
            t0 = time.perf_counter()
            path = local_dir(resolve_source(name))
            print(f"{name}: ready in {path} ({time.perf_counter() - t0:.1f} s)")
    except EnsembleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_models_plan(args) -> int:
    """The memory plan of a member set on its devices, without loading weights; exit 2 when it does
    not fit (the error gives the numbers and the fix)."""
    from .engine import Ensemble
    from .errors import EnsembleError

    devices = args.device.split(",") if "," in args.device else args.device
    try:
        members = member_specs(args.models)
        engine = Ensemble(members, device=devices, dtype=args.dtype)  # the default method for the count
        plan = engine.plan(context_tokens=args.context)
        print(plan.table())
        plan.check()
    except (EnsembleError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_bench(args) -> int:
    import importlib.util

    from . import DEFAULT_MODELS
    from .bench import resolve_tasks, run_bench, write

    models = args.models.split(",") if args.models else list(DEFAULT_MODELS)
    if importlib.util.find_spec("matplotlib") is None:
        print('error: the bench needs the bench extra: pip install "ensemble-llm[bench]"', file=sys.stderr)
        return 2

    def run(specs):
        tasks = [] if args.no_tasks else resolve_tasks(args.tasks or DEFAULT_TASKS, args.examples)
        return run_bench(
            models,
            specs,
            tasks,
            speed_prompts=args.speed_prompts,
            max_new_tokens=args.max_new_tokens,
            third_member=args.third_member,
            device=args.device,
            progress=not args.quiet,
            preambles=not args.no_preamble,
            shots=args.shots,
        )

    return _run_and_write(args, models, run, write)


def _run_and_write(args, models, run, write) -> int:
    """A bench command's common part: parse the methods, run, write the results and print them."""
    from pathlib import Path

    from . import EnsembleError
    from .bench import parse_methods

    try:
        specs = parse_methods(args.methods, len(models))
        t0 = time.perf_counter()
        results = run(specs)
        results["command"] = "ensemble-llm " + " ".join(shlex.quote(a) for a in args.argv)
        paths = write(results, Path(args.out))
    except EnsembleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(Path(args.out, "results.md").read_text())
    print(
        f"[ensemble-llm] wrote {', '.join(map(str, paths))} in {(time.perf_counter() - t0) / 60:.1f} min",
        file=sys.stderr,
    )
    return 0


def _cmd_bench_constraints(args) -> int:
    from . import DEFAULT_MODELS
    from .bench.constraints import run_constraint_bench, write

    models = args.models.split(",") if args.models else list(DEFAULT_MODELS)
    return _run_and_write(
        args,
        models,
        lambda specs: run_constraint_bench(
            models,
            specs,
            n_schemas=args.schemas,
            max_new_tokens=args.max_new_tokens,
            cost_prompts=args.cost_prompts,
            cost_tokens=args.cost_tokens,
            device=args.device,
            progress=not args.quiet,
            sections=args.sections,
            tight_tokens=args.tight_tokens,
            n_tight=args.tight_schemas,
        ),
        write,
    )


def _cmd_serve(args) -> int:
    import importlib.util

    from . import EnsembleError

    if not all(importlib.util.find_spec(m) for m in ("fastapi", "pydantic", "uvicorn", "prometheus_client")):
        print('error: serving needs the serve extra: pip install "ensemble-llm[serve]"', file=sys.stderr)
        return 2
    from .engine import Ensemble
    from .serve import serve
    from .serve_requests import Limits

    try:
        api_key = _api_key(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    limits = Limits(body_bytes=int(args.max_body_mb * 2**20), check_seconds=args.check_timeout)
    try:
        models = member_specs(args.models)
        print(f"[ensemble-llm] loading; then serving on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        kv_budget = None if args.kv_budget == "none" else args.kv_budget
        engine = Ensemble(
            models, args.method, device=args.device, max_batch=args.max_batch, kv_budget=kv_budget, **_placement(args)
        )
        serve(
            engine,
            host=args.host,
            port=args.port,
            allowed=args.allowed_host,
            api_key=api_key,
            max_queue=args.max_queue,
            limits=limits,
            cors_origins=args.cors_origin,
            docs=args.docs,
        )
    except EnsembleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _api_key(args) -> str | None:
    """The key from --api-key-file, else --api-key (visible in `ps`: warned), else $ENSEMBLE_LLM_API_KEY."""
    from pathlib import Path

    from .serve_http import API_KEY_ENV

    if args.api_key_file and args.api_key:
        raise ValueError("give the key once: --api-key or --api-key-file, not both")
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the API key file {args.api_key_file}: {exc}") from None
        if not key:
            raise ValueError(f"the API key file {args.api_key_file} is empty; write the key into it")
        return key
    if args.api_key:
        print(
            f"[ensemble-llm] warning: --api-key shows in the process list; prefer {API_KEY_ENV} or --api-key-file",
            file=sys.stderr,
        )
        return args.api_key
    return os.environ.get(API_KEY_ENV) or None


from .bench.specs import DEFAULT_METHODS  # noqa: E402  (light: neither imports torch)
from .bench.tasks import DEFAULT_TASKS, SUITE  # noqa: E402

MODELS_HELP = "comma-separated members, or a JSON list of names and member dicts (default: the bundled pair)"


def _add_members(p: argparse.ArgumentParser) -> None:
    """The options every command that builds an engine takes: the members and the device."""
    p.add_argument("--models", default=None, help=MODELS_HELP)
    p.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="answer a prompt with the ensemble")
    g.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    _add_members(g)
    g.add_argument(
        "--method",
        default=None,
        help=f"single, unite, safe, specfuse, smc or auto (default: {defaults.ENSEMBLE_METHOD} for 2+ members, else "
        "single)",
    )
    g.add_argument("--max-new-tokens", type=int, default=defaults.MAX_NEW_TOKENS)
    g.add_argument("--temperature", type=float, default=defaults.TEMPERATURE)
    g.add_argument("--top-p", type=float, default=defaults.TOP_P)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeat for several)")
    g.add_argument("--system", default=None, help="a system message before the prompt")
    g.add_argument("--method-config", default=None, help="the method's options as JSON, e.g. '{\"segment_len\": 8}'")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16 or float16")
    _add_placement(g)
    g.add_argument("--raw", action="store_true", help="use the prompt as is (no chat template)")
    g.add_argument("-v", "--verbose", action="store_true", help="say which method and members run, and the load time")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--stats", action="store_true", help="print usage and stats as JSON on stderr")
    g.add_argument(
        "--logprobs",
        type=int,
        nargs="?",
        const=0,
        default=None,
        metavar="K",
        help="print the reply's tokens with the ensemble's and each member's log-probabilities on stderr "
        "(and K alternatives per token)",
    )
    g.set_defaults(func=_cmd_generate)


def _add_models(sub) -> None:
    m = sub.add_parser("models", help="bundled models")
    msub = m.add_subparsers(dest="models_command", required=True)
    ml = msub.add_parser("list", help="list bundled models and whether they are ready")
    ml.set_defaults(func=_cmd_models_list)
    mp = msub.add_parser("pull", help="fetch and convert bundled models (default: the default pair)")
    mp.add_argument("names", nargs="*")
    mp.set_defaults(func=_cmd_models_pull)
    mpl = msub.add_parser(
        "plan",
        help="memory each member needs (weights + KV cache) on its devices, read from headers: no weights load",
    )
    mpl.add_argument(
        "--models",
        required=True,
        help="comma-separated members, or a JSON list of members and member dicts, e.g. "
        '[{"model": "org/name", "device_map": "auto", "max_memory": {"0": "20GiB", "cpu": "60GiB"}}]',
    )
    mpl.add_argument("--device", default="auto", help="'auto', a device, or one per member, comma-separated")
    mpl.add_argument("--dtype", default="auto", help="'auto' (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    mpl.add_argument(
        "--context", type=int, default=None, help="KV-cache tokens per member (default: min(4096, context window))"
    )
    mpl.set_defaults(func=_cmd_models_plan)


def _add_bench(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="speed, cost and quality of every method side by side, with plots",
        description="Runs every method on the same prompts, interleaved, and writes results.json, "
        "results.md and PNG plots. Methods: names with optional config, e.g. "
        "'single' (one per member), 'safe', 'smc:f=min,n_particles=4'.",
    )
    _add_members(b)
    b.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), help=f"default: {' '.join(DEFAULT_METHODS)}")
    b.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        help="bundled task names or files in the BIG-bench jsonl format, each optionally NAME:N; "
        "'suite[:N]' is the seven-task dev suite (" + " ".join(SUITE) + ") "
        f"(default: {' '.join(DEFAULT_TASKS)}, bundled BIG-bench dev samples)",
    )
    b.add_argument("--no-tasks", action="store_true", help="speed figures only")
    b.add_argument("--examples", type=int, default=20, help="scored examples of a task given without :N")
    b.add_argument(
        "--shots",
        choices=["fixed", "drawn"],
        default="fixed",
        help="fixed: one prompt's three shots (the task's first lines) for every example; drawn: each "
        "example's own three shots (task files of benchmarks/bigbench_split.py)",
    )
    b.add_argument("--speed-prompts", type=int, default=3, help="chat prompts for the speed figures (max 20)")
    b.add_argument("--max-new-tokens", type=int, default=40, help="budget of each speed prompt")
    b.add_argument(
        "--third-member",
        default=None,
        help="also run every ensemble method with this third member, e.g. qwen2.5-coder-1.5b-instruct",
    )
    b.add_argument(
        "--no-preamble",
        action="store_true",
        help="give no member a preamble (measures what the base-model preamble does)",
    )
    b.add_argument("--out", default="bench-results")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=_cmd_bench)


def _add_bench_constraints(sub) -> None:
    c = sub.add_parser(
        "bench-constraints",
        help="grammar-constrained decoding per method: valid calls and cost",
        description="Every method writes a forced tool call for each bundled JSON Schema (validated "
        "with jsonschema), and answers prompts freely and with the schema as "
        "response_format (the constraint's cost per token).",
    )
    _add_members(c)
    c.add_argument("--methods", nargs="+", default=["single", "unite", "safe", "specfuse", "smc:n_particles=2"])
    c.add_argument("--schemas", type=int, default=None, help="the first N schemas of the corpus (default: all 32)")
    c.add_argument("--cost-prompts", type=int, default=6, help="schemas also run free vs response_format")
    c.add_argument("--cost-tokens", type=int, default=48, help="budget of each free / response_format answer")
    c.add_argument("--max-new-tokens", type=int, default=160)
    c.add_argument(
        "--sections",
        nargs="+",
        default=["calls", "cost", "tight"],
        choices=["calls", "cost", "tight"],
        help="forced calls, constraint cost, tight-budget response_format (default: all three)",
    )
    c.add_argument("--tight-tokens", type=int, default=64, help="budget of each tight-budget reply")
    c.add_argument(
        "--tight-schemas",
        type=int,
        default=None,
        help="the first N schemas of the tight-budget corpus (default: all 11)",
    )
    c.add_argument("--out", default="bench-constraints")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_cmd_bench_constraints)


def _add_serve(sub) -> None:
    sv = sub.add_parser(
        "serve",
        help="serve the ensemble over an OpenAI-compatible HTTP API",
        description="POST /v1/chat/completions and /v1/completions (streams as server-sent "
        "events), GET /v1/models, /health and /metrics. Binds to 127.0.0.1 unless told.",
    )
    _add_members(sv)
    sv.add_argument(
        "--method",
        default=None,
        help="default: auto (specfuse for raw prompts, safe for chat) for 2+ members, else single",
    )
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (also read from $ENSEMBLE_LLM_API_KEY or --api-key-file, "
        "which keep it out of the process list)",
    )
    sv.add_argument("--api-key-file", default=None, help="a file holding the API key")
    sv.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        help="a Host name (or address) clients use, besides the loopback names and --host; repeat for several; "
        "'*' answers any (other Hosts get 421)",
    )
    sv.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        help="a browser origin (e.g. https://app.example.com) allowed to call the API; repeat for several "
        "(default: none, CORS closed)",
    )
    sv.add_argument("--docs", action="store_true", help="serve /docs, /redoc and /openapi.json (off by default)")
    sv.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body, in MiB (larger: 413)")
    sv.add_argument(
        "--check-timeout",
        type=float,
        default=10.0,
        help="seconds a request's checks (its JSON Schema and tools compiled) may take before a 400",
    )
    sv.add_argument("--max-queue", type=int, default=64, help="requests waiting or running before 429")
    sv.add_argument(
        "--max-batch",
        default="auto",
        type=lambda v: v if v == "auto" else int(v),
        help='requests decoded at once, batched per member ("auto": 8 CPU, 32 CUDA)',
    )
    sv.add_argument(
        "--kv-budget",
        default="auto",
        help='KV-cache bytes running requests may hold per device, e.g. 2GB ("auto": 90%% of free GPU '
        'memory, half the free RAM; "none": no limit); others wait, one that never fits gets a 400',
    )
    _add_placement(sv)
    sv.set_defaults(func=_cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ensemble-llm", description="Ensembles of local causal LMs.")
    p.add_argument("--version", action="version", version=f"ensemble-llm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_generate, _add_models, _add_bench, _add_bench_constraints, _add_serve):
        add(sub)
    return p


@contextlib.contextmanager
def _quiet():
    """No third-party chatter while a command runs: transformers' "Loading weights" bars, and the
    warnings libraries log when imported (torchao's optional kernels, torch's pytree notices).
    Errors still raise; what it changes is put back after (main() may run inside a process)."""
    import logging
    import warnings

    before_level, before_bars = logging.root.manager.disable, os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before_level)
        if before_bars is None:
            os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
        else:
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = before_bars


def main(argv: list[str] | None = None) -> int:
    return _dispatch(_parse(argv))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args


def _dispatch(args: argparse.Namespace) -> int:
    if getattr(args, "verbose", True):
        return args.func(args)
    with _quiet():  # generate: the answer only (our own download bars stay)
        return args.func(args)


def run() -> None:
    """The `ensemble-llm` command. After a local `generate` it leaves without the interpreter's
    teardown of the loaded models (a visible part of a warm answer): the answer is printed and
    flushed and nothing is left to save. Ray placement exits normally (ray.shutdown runs at exit)."""
    args = _parse(None)
    code = _dispatch(args)
    if args.command == "generate" and args.placement == "local":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
