"""Hub members for real, with no mock of huggingface_hub: a small HTTP server on 127.0.0.1 serves
real models in the hub's layout (the API endpoints huggingface_hub calls and /{repo}/resolve/
{revision}/{file} with ETag, X-Repo-Commit, Content-Length and Range support), and the loading
code runs in subprocesses whose HF_ENDPOINT points at it (huggingface_hub reads it at import)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import torch
from helpers import SMOL, greedy, tiny_llama

ROOT = Path(__file__).resolve().parents[1]
LFS_MIN = 1 << 20  # files from 1 MiB are LFS files on the hub: sha256 etags and an "lfs" tree entry


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubFile:
    path: Path  # served from disk, read in slices

    @cached_property
    def size(self) -> int:
        return self.path.stat().st_size

    @cached_property
    def oid(self) -> str:
        return git_blob_sha(self.path.read_bytes())

    def read(self, start: int, end: int) -> bytes:
        with open(self.path, "rb") as fh:
            fh.seek(start)
            return fh.read(end - start)

    @cached_property
    def etag(self) -> str:
        data_hash = hashlib.sha256() if self.size >= LFS_MIN else None
        if data_hash is None:
            return git_blob_sha(self.path.read_bytes())
        with open(self.path, "rb") as fh:
            while block := fh.read(1 << 20):
                data_hash.update(block)
        return data_hash.hexdigest()


@dataclass
class Repo:
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)  # commit -> path -> file


@dataclass
class Fault:
    """How GETs of one file body go wrong: the first `fail` of them fail; the first failure sends
    half the body then drops the connection, later ones drop it before any answer."""

    fail: int = 0
    chunk_delay: float = 0.0  # seconds between 64 KiB chunks (a slow transfer)


class FakeHub:
    """The hub on 127.0.0.1: repos, a request log and per-file faults."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.faults: dict[tuple[str, str], Fault] = {}
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub.handle(self, head=True)

            def do_GET(self):
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, repo_id: str, folder: Path, refs: tuple[str, ...] = ("main",)) -> str:
        """Serve the files of `folder` as a new commit of `repo_id` that `refs` point at."""
        repo = self.repos.setdefault(repo_id, Repo())
        commit = hashlib.sha1(f"{repo_id}|{folder}|{len(repo.commits)}".encode()).hexdigest()
        repo.commits[commit] = {
            str(p.relative_to(folder)): HubFile(p) for p in sorted(folder.rglob("*")) if p.is_file()
        }
        for ref in refs:
            repo.refs[ref] = commit
        return commit

    def gets(self, repo_id: str, filename: str, whole: bool = True) -> list[str | None]:
        """Range headers of the GETs of a file's body (whole=True: header reads, bytes=0-N, left out)."""
        prefix = f"/{repo_id}/resolve/"
        out = []
        for method, path, rng in self.log:
            if method == "GET" and path.startswith(prefix) and path.endswith("/" + filename):
                if not (whole and rng and rng.startswith("bytes=0-") and rng != "bytes=0-"):
                    out.append(rng)
        return out

    # ---- request handling ------------------------------------------------------------------
    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        with self.lock:
            self.log.append(("HEAD" if head else "GET", path, h.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self.api(h, "/".join(parts[2:4]), parts[4:])
        if len(parts) >= 5 and parts[2] == "resolve":
            return self.resolve(h, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), head)
        self.send(h, 404, {"error": "not found"})

    def send(self, h, status: int, body, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        h.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
            h.send_header(k, v)
        h.end_headers()
        if h.command != "HEAD":  # a HEAD answer has no body: one left on a kept-alive connection
            h.wfile.write(data)  # would be read as the next answer's status line (a flaky test)

    def commit_of(self, h, repo_id: str, rev: str) -> tuple[Repo, str] | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self.send(h, 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            return None
        commit = repo.refs.get(rev, rev if rev in repo.commits else None)
        if commit is None:
            self.send(h, 404, {"error": f"Invalid rev id: {rev}"}, {"X-Error-Code": "RevisionNotFound"})
            return None
        return repo, commit

    def api(self, h, repo_id: str, rest: list[str]) -> None:
        rev = rest[1] if len(rest) >= 2 and rest[0] in ("revision", "tree") else "main"
        found = self.commit_of(h, repo_id, rev)
        if found is None:
            return
        repo, commit = found
        files = repo.commits[commit]
        if rest and rest[0] == "tree":
            entries = []
            for name, f in files.items():
                entry = {"type": "file", "path": name, "size": f.size, "oid": f.oid}
                if f.size >= LFS_MIN:
                    entry["lfs"] = {"oid": f.etag, "size": f.size, "pointerSize": 134}
                entries.append(entry)
            return self.send(h, 200, entries)
        self.send(
            h, 200, {"id": repo_id, "sha": commit, "private": False, "siblings": [{"rfilename": n} for n in files]}
        )

    def resolve(self, h, repo_id: str, rev: str, name: str, head: bool) -> None:
        found = self.commit_of(h, repo_id, rev)
        if found is None:
            return
        repo, commit = found
        f = repo.commits[commit].get(name)
        if f is None:
            return self.send(
                h, 404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}
            )
        size, start, end = f.size, 0, f.size
        rng = h.headers.get("Range")
        if rng:
            a, _, b = rng.removeprefix("bytes=").partition("-")
            start, end = int(a), min(int(b) + 1, size) if b else size
        headers = {"ETag": f'"{f.etag}"', "X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if f.size >= LFS_MIN:
            headers.update({"X-Linked-Etag": f'"{f.etag}"', "X-Linked-Size": str(size)})
        header_read = bool(rng) and start == 0 and end < size
        fault = self.faults.get((repo_id, name))
        if not head and fault is not None and fault.fail > 0 and not header_read:
            fault.fail -= 1
            first = not rng
            h.close_connection = True
            if first:  # the whole body announced, half of it sent, then the connection drops
                h.send_response(200)
                h.send_header("Content-Length", str(size))
                for k, v in headers.items():
                    h.send_header(k, v)
                h.end_headers()
                h.wfile.write(f.read(0, size // 2))
                h.wfile.flush()
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.send_response(206 if rng else 200)
        h.send_header("Content-Length", str(end - start))
        if rng:
            h.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if head:
            return
        delay = fault.chunk_delay if fault is not None else 0.0
        for pos in range(start, end, 1 << 16):
            h.wfile.write(f.read(pos, min(pos + (1 << 16), end)))
            if delay:
                time.sleep(delay)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- the code under test, in a subprocess --------------------------------------------------------
WORKER = r"""
import json, sys, traceback
from pathlib import Path
from ensemble_llm.members import clear_cache, load_member, resolve_source
from ensemble_llm.members.options import member_options
from ensemble_llm.members.plan import plan_members
import torch

def run(action):
    op = action["op"]
    if op == "load":
        opts = member_options(action.get("options", {}), "m")
        m = load_member(action["spec"], device="cpu", progress=False, options=opts)
        state = m.prefill(m.prompt_ids("Hello, my name is"))
        ids = []
        for _ in range(8):
            ids.append(int(state.next_logprobs.argmax()))
            m.extend(state, [ids[-1]])
        clear_cache()
        return {"folder": m.source, "ids": ids, "text": m.decode(ids)}
    if op == "plan":
        opts = member_options(action.get("options", {}), "m")
        plan = plan_members([resolve_source(action["spec"])], ["cpu"], [torch.float32], [opts])
        row = plan.members[0]
        return {"params": row.params, "kv_per_token": row.kv_per_token, "origin": row.origin, "table": plan.table()}
    if op == "files":
        root = Path(action["root"])
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink())
    raise ValueError(op)

out = []
for action in json.loads(sys.argv[1]):
    try:
        out.append({"ok": True, "value": run(action)})
    except Exception as exc:
        trace = traceback.format_exc()[-3000:]
        out.append({"ok": False, "type": type(exc).__name__, "message": str(exc), "trace": trace})
print("RESULT:" + json.dumps(out))
"""


def worker_env(hub: FakeHub, home: Path, offline: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(home / "hf"),
        HF_HUB_OFFLINE="1" if offline else "0",
        HF_HUB_DISABLE_TELEMETRY="1",
        ENSEMBLE_LLM_CACHE=str(home / "ensemble"),
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        TRANSFORMERS_VERBOSITY="error",
    )
    return env


def start(actions: list[dict], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, json.dumps(actions)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[list[dict], str]:
    out, _ = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("RESULT:")]
    assert lines, out[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT:")), out


def run_worker(actions: list[dict], env: dict) -> tuple[list[dict], str]:
    return finish(start(actions, env))


def ok(result: dict):
    assert result["ok"], result.get("trace")
    return result["value"]


def greedy_ids(folder: str) -> list[int]:
    from ensemble_llm.members import load_member

    return greedy(load_member(folder, device="cpu"), "Hello, my name is", 8)[0]


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizers):
    """Tiny random-weight Llama models with the real SmolLM2 tokenizer, saved with save_pretrained:
    two versions (seeds), and the hub serving them under several repos."""

    folders = {}
    for seed, hidden in ((1, 32), (2, 32), (3, 128)):  # 3: weights over 20 MB, past huggingface_hub's 10 MB chunks
        torch.manual_seed(seed)
        tok = tokenizers[SMOL]
        path = tmp_path_factory.mktemp(f"served_{seed}")
        tiny_llama(len(tok), hidden=hidden).save_pretrained(path)
        tok.save_pretrained(path)
        folders[seed] = path
    hub = FakeHub()
    commits = {
        "v1": hub.add("tiny/versions", folders[1], refs=("v1",)),
        "main": hub.add("tiny/versions", folders[2], refs=("main",)),
    }
    for repo in ("tiny/smol", "tiny/broken", "tiny/slow", "tiny/remote", "tiny/other"):
        hub.add(repo, folders[1])
    hub.add("tiny/flaky", folders[3])
    hub.faults[("tiny/flaky", "model.safetensors")] = Fault(fail=1)
    hub.faults[("tiny/broken", "model.safetensors")] = Fault(fail=6)  # huggingface_hub's 1 try + 5 resumes
    hub.faults[("tiny/slow", "model.safetensors")] = Fault(chunk_delay=0.03)
    yield hub, folders, commits
    hub.close()


@pytest.fixture(scope="module")
def first_start(served, tmp_path_factory):
    """One process on an empty cache: a plan, first downloads, a revision, a missing repo and
    revision, a dropped connection resumed, a broken download then its retry; returns (its cache
    home, the results)."""
    hub, _, _ = served
    home = tmp_path_factory.mktemp("first_start")
    results, _ = run_worker(
        [
            {"op": "plan", "spec": "tiny/remote"},
            {"op": "load", "spec": "tiny/smol"},
            {"op": "load", "spec": "tiny/versions", "options": {"revision": "v1"}},
            {"op": "load", "spec": "tiny/versions"},
            {"op": "load", "spec": "tiny/nowhere"},
            {"op": "load", "spec": "tiny/versions", "options": {"revision": "v9"}},
            {"op": "load", "spec": "tiny/flaky"},
            {"op": "load", "spec": "tiny/broken"},
            {"op": "files", "root": str(home / "hf" / "hub" / "models--tiny--broken")},
            {"op": "load", "spec": "tiny/broken"},
        ],
        worker_env(hub, home),
    )
    return home, results


@pytest.mark.slow  # downloads in subprocesses from the loopback hub
def test_first_download_revision_missing_repo_and_a_resumed_drop(served, first_start):
    hub, folders, commits = served
    _, results = first_start
    plan, smol, v1, main, missing, bad_rev, flaky = results[:7]
    # the plan of a model not downloaded: the hub's safetensors metadata (header by range request) + config.json
    from ensemble_llm.members.plan import safetensors_params

    plan = ok(plan)
    assert (
        plan["params"] == safetensors_params(folders[1]) and plan["origin"] == "hub safetensors metadata of tiny/remote"
    )
    assert hub.gets("tiny/remote", "model.safetensors") == []  # no weight body fetched for the plan
    # a first download: the same files, and the model generates what the served one does
    expected = {1: greedy_ids(str(folders[1])), 2: greedy_ids(str(folders[2]))}
    smol = ok(smol)
    assert sha256(Path(smol["folder"]) / "model.safetensors") == sha256(folders[1] / "model.safetensors")
    assert smol["ids"] == expected[1] and smol["text"]
    assert hub.gets("tiny/smol", "model.safetensors") == [None]  # fetched once, whole
    # a revision (a tag) and the main branch: each its own commit and weights
    assert Path(ok(v1)["folder"]).name == commits["v1"] and ok(v1)["ids"] == expected[1]
    assert Path(ok(main)["folder"]).name == commits["main"] and ok(main)["ids"] == expected[2]
    weights = {k: sha256(folders[k] / "model.safetensors") for k in (1, 2)}
    assert weights[1] != weights[2]
    assert sha256(Path(ok(v1)["folder"]) / "model.safetensors") == weights[1]
    assert sha256(Path(ok(main)["folder"]) / "model.safetensors") == weights[2]
    # a missing repo and a missing revision: clear errors naming them
    assert missing["type"] == "ModelNotFoundError" and "hub repo 'tiny/nowhere' does not exist" in missing["message"]
    assert bad_rev["type"] == "ModelNotFoundError" and "has no revision 'v9'" in bad_rev["message"]
    # a connection dropped mid-file: huggingface_hub kept the chunks it had and resumed with a Range request
    flaky = ok(flaky)
    ranges = hub.gets("tiny/flaky", "model.safetensors")
    size = (folders[3] / "model.safetensors").stat().st_size
    assert len(ranges) == 2 and ranges[0] is None and ranges[1].startswith("bytes="), ranges
    assert 0 < int(ranges[1].removeprefix("bytes=").rstrip("-")) <= size // 2  # not from the start again
    assert sha256(Path(flaky["folder"]) / "model.safetensors") == sha256(folders[3] / "model.safetensors")
    assert flaky["ids"] == greedy_ids(str(folders[3]))


@pytest.mark.slow  # downloads in subprocesses from the loopback hub
def test_a_cached_model_starts_without_the_hub_and_offline_keeps_the_clear_error(served, first_start):
    hub, folders, _ = served
    home, results = first_start
    folder = ok(results[1])["folder"]  # tiny/smol, downloaded by the first start
    before = len(hub.log)
    again, _ = run_worker([{"op": "load", "spec": "tiny/smol"}], worker_env(hub, home))
    assert ok(again[0])["folder"] == folder
    assert hub.log[before:] == []  # a complete cached snapshot: not one request, no weight fetched again
    offline, _ = run_worker(
        [
            {"op": "load", "spec": "tiny/smol"},
            {"op": "load", "spec": "tiny/other"},
            {"op": "plan", "spec": "tiny/other"},
            {"op": "plan", "spec": "tiny/smol"},
        ],
        worker_env(hub, home, offline=True),
    )
    assert ok(offline[0])["folder"] == folder
    assert offline[1]["type"] == "ModelNotFoundError"
    message = offline[1]["message"]
    assert "'tiny/other' is not in the local Hugging Face cache and HF_HUB_OFFLINE=1" in message
    assert "`hf download tiny/other`" in message
    unknown, cached = ok(offline[2]), ok(offline[3])  # offline, a plan says "unknown" rather than guess
    assert unknown["params"] is None and "size unknown" in unknown["origin"] and "unknown" in unknown["table"]
    assert cached["params"] == ok(results[0])["params"] and cached["origin"].startswith("safetensors headers in")
    assert hub.log[before:] == []


@pytest.mark.slow  # downloads in subprocesses from the loopback hub
def test_a_broken_download_leaves_nothing_half_written_and_the_next_start_completes_it(served, first_start):
    hub, folders, _ = served
    _, results = first_start
    failed, files, loaded = results[7:]
    assert failed["type"] == "ModelNotFoundError"
    assert "downloading its files from hub repo 'tiny/broken' failed" in failed["message"]
    assert "Nothing half-written was kept" in failed["message"]
    files = ok(files)
    assert not any(f.endswith(".incomplete") for f in files), files
    assert not any(f.endswith("/model.safetensors") for f in files), files  # no weight file in the snapshot
    assert len(hub.gets("tiny/broken", "model.safetensors")) == 7  # 6 broken tries, then one whole transfer
    assert sha256(Path(ok(loaded)["folder"]) / "model.safetensors") == sha256(folders[1] / "model.safetensors")


@pytest.mark.slow  # downloads in subprocesses from the loopback hub
def test_two_processes_downloading_one_model_do_not_clash(served, tmp_path):
    hub, folders, _ = served
    env = worker_env(hub, tmp_path)
    procs = [start([{"op": "load", "spec": "tiny/slow"}], env) for _ in range(2)]
    results = [finish(p)[0][0] for p in procs]
    a, b = (ok(r) for r in results)
    assert a["folder"] == b["folder"] and a["ids"] == b["ids"] == greedy_ids(str(folders[1]))
    assert sha256(Path(a["folder"]) / "model.safetensors") == sha256(folders[1] / "model.safetensors")
    assert hub.gets("tiny/slow", "model.safetensors") == [None]  # huggingface_hub's file lock: one transfer


@pytest.mark.real
def test_a_gguf_file_in_a_hub_repo_downloads_converts_once_and_generates(served, tmp_path):
    from ensemble_llm.members.fetch import fetch_bundled
    from ensemble_llm.members.registry import BUNDLED

    hub, _, _ = served
    gguf = fetch_bundled(BUNDLED[SMOL], progress=False)
    folder = tmp_path / "gguf_repo"
    folder.mkdir()
    (folder / gguf.name).symlink_to(gguf)
    hub.add("bartowski/smol-gguf", folder)
    spec = f"bartowski/smol-gguf:{gguf.name}"
    hf = {"backend": "transformers"}
    actions = [{"op": "load", "spec": spec}, {"op": "load", "spec": spec}]
    actions += [{"op": "load", "spec": spec, "options": hf}, {"op": "load", "spec": spec, "options": hf}]
    results, out = run_worker(actions, worker_env(hub, tmp_path))
    first, second, third, fourth = (ok(r) for r in results)
    # on llama.cpp (the default for a GGUF): the downloaded file itself, nothing converted
    assert first["folder"] == second["folder"] and first["folder"].endswith(gguf.name)
    assert first["ids"] == second["ids"] and first["text"].strip()
    assert out.count("converting") == 1  # transformers converts once; its second load reuses the folder
    assert third["folder"] == fourth["folder"] and third["ids"] == fourth["ids"] and third["text"].strip()
    assert hub.gets("bartowski/smol-gguf", gguf.name) == [None]
    info = json.loads((Path(third["folder"]) / "ensemble_llm_source.json").read_text())
    assert info["hub"] == spec


def test_hub_specs_resolve_without_the_network(tmp_path):
    from ensemble_llm.errors import ModelNotFoundError
    from ensemble_llm.members import resolve_source
    from ensemble_llm.members.hub import split_hub_ref

    assert split_hub_ref("Qwen/Qwen2.5-7B-Instruct") == ("Qwen/Qwen2.5-7B-Instruct", None)
    assert split_hub_ref("org/repo:sub/model-Q4_K_M.gguf") == ("org/repo", "sub/model-Q4_K_M.gguf")
    for not_hub in ("./a/b", "/abs/path", "~/x/y", "org/repo:notes.txt", "org/repo:../x.gguf", "a/b/c", "C:/x.gguf"):
        assert split_hub_ref(not_hub) is None, not_hub
    src = resolve_source("bartowski/Qwen2.5-7B-Instruct-GGUF:Qwen2.5-7B-Instruct-Q4_K_M.gguf")
    assert (src.kind, src.name) == ("hub-gguf", "Qwen2.5-7B-Instruct-Q4_K_M")
    assert resolve_source("Qwen/Qwen2.5-7B-Instruct").kind == "hub"
    local = tmp_path / "m.gguf"
    local.write_bytes(b"GGUF" + bytes(20))
    assert resolve_source(str(local)).kind == "gguf"  # a local file stays local
    with pytest.raises(ModelNotFoundError, match="'org/name:file.gguf'"):
        resolve_source("no-such-model")
