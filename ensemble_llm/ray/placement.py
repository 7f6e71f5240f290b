"""Placing members on a Ray cluster: joining it, checking `member_resources`, one actor per member
in its own placement group, reused across engines of this process."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
from typing import Any, Sequence

from ..errors import ConfigError
from .actor import MAX_RESTARTS, PLACEMENT_TIMEOUT_S, RESOURCE_KEYS, MemberActor, _ray
from .member import RayMember

log = logging.getLogger("ensemble_llm.ray")
AUTH_MODE_ENV = "RAY_AUTH_MODE"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's single-machine mode, on the loopback address

# ---- placing members on a cluster -------------------------------------------------------------
_ACTORS: dict[tuple, RayMember] = {}
_ACTORS_LOCK = threading.Lock()


def connect(address: str | None):
    """Join the cluster at `address` ("auto", "ray://host:10001", "host:6379"), or the one this
    process already joined, or (None, nothing joined) start a local one: with Ray's token
    authentication, and listening on the loopback interface only (`_local_cluster_env`)."""
    joined = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    if address is None and not joined:
        _local_cluster_env()
    ray = _ray()
    if ray.is_initialized():
        return ray
    try:
        ray.init(
            address=address,
            ignore_reinit_error=True,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"cannot reach the Ray cluster at {address!r} ({exc}); start one with `ray start --head` "
            "and pass its address (ray_address='auto' on a node of it, or 'ray://HEAD:10001'), or "
            "leave ray_address=None for a local cluster."
        ) from exc
    return ray


def _local_cluster_env() -> None:
    """Settings for the local cluster this process starts. Anyone who reaches a Ray cluster's
    ports can run code in it, so: token authentication (RAY_AUTH_MODE=token; Ray >= 2.59 also
    turns it on by default for a local cluster), and the node's address is the loopback one, so
    that Ray's services listen on 127.0.0.1 only. Ray has no option for the latter on Linux; it
    reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (its single-machine mode: "no cluster, use the
    loopback address") when it is imported, so a Ray imported before this runs keeps listening
    on the node's routable address (token auth still holds; logged). Settings the caller made
    in the environment are kept."""
    if os.environ.setdefault(AUTH_MODE_ENV, "token") != "token":
        log.warning(
            "%s=%s: the local Ray cluster starts without token authentication", AUTH_MODE_ENV, os.environ[AUTH_MODE_ENV]
        )
    if "ray" in sys.modules:
        if os.environ.get(LOOPBACK_ENV) != "0":
            log.warning("Ray was imported before the local cluster started: it listens on the node's address")
        return
    os.environ.setdefault(LOOPBACK_ENV, "0")


def check_member_resources(value, n: int) -> list[dict] | None:
    """member_resources: None (defaults), one dict for every member, or a list of one dict (or None) each."""
    if value is None:
        return None
    items = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(items) != n:
        raise ConfigError(
            f"member_resources lists {len(items)} entries for {n} members; give one per member (or one dict for all)."
        )
    out = []
    for i, item in enumerate(items):
        if item is None:
            out.append({})
            continue
        if not isinstance(item, dict):
            raise ConfigError(f"member_resources[{i}] must be a dict like {{'num_gpus': 1}}, got {item!r}")
        bad = sorted(set(item) - set(RESOURCE_KEYS))
        if bad:
            raise ConfigError(f"member_resources[{i}] has unknown keys {bad}; use {', '.join(RESOURCE_KEYS)}.")
        for k in ("num_cpus", "num_gpus", "memory"):
            v = item.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf):
                raise ConfigError(f"member_resources[{i}]['{k}'] must be a number >= 0, got {v!r}")
        res = item.get("resources")
        if res is not None and (
            not isinstance(res, dict)
            or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                for k, v in res.items()
            )
        ):
            raise ConfigError(
                f"member_resources[{i}]['resources'] must map custom resource names to amounts, got {res!r}"
            )
        t = item.get("torch_threads")
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ConfigError(f"member_resources[{i}]['torch_threads'] must be an integer >= 1, got {t!r}")
        out.append(dict(item))
    return out


def _bundle(res: dict, has_gpu: bool) -> dict:
    """A member's Ray bundle: its member_resources, else one GPU where the cluster has GPUs, else one CPU."""
    if "num_gpus" not in res and "num_cpus" not in res:
        res = {**res, **({"num_gpus": 1, "num_cpus": 1} if has_gpu else {"num_cpus": 1})}
    b = {"CPU": float(res.get("num_cpus", 0) or 0), "GPU": float(res.get("num_gpus", 0) or 0)}
    if res.get("memory"):
        b["memory"] = float(res["memory"])
    b.update({k: float(v) for k, v in (res.get("resources") or {}).items()})
    b = {k: v for k, v in b.items() if v > 0}
    return b or {"CPU": 0.01}  # a Ray bundle must ask for something


def place_members(
    specs: Sequence[str],
    names: Sequence[str],
    *,
    ray_address: str | None,
    member_resources: list[dict] | None,
    dtype: Any,
    cache_dir,
    trust_remote_code: bool,
    options: Sequence[Any] | None = None,
) -> list[RayMember]:
    """One actor per member (reused by later engines in this process for the same model and
    resources). Resources the cluster cannot give fail here, before any model loads. Each actor
    fetches (and converts) its model where it runs; the caller gets the tokenizer files from it."""
    ray = connect(ray_address)
    total = ray.cluster_resources()
    has_gpu = total.get("GPU", 0) > 0
    res = member_resources or [{} for _ in specs]
    bundles = [_bundle(r, has_gpu) for r in res]
    opts = list(options or [None] * len(specs))  # each member's MemberOptions, loaded with in its actor
    keys = [
        (s, repr(sorted(r.items())), str(dtype), str(cache_dir), trust_remote_code, o)
        for s, r, o in zip(specs, res, opts)
    ]
    with _ACTORS_LOCK:
        todo = [i for i, k in enumerate(keys) if k not in _ACTORS or not _alive(_ACTORS[k])]
        if todo:
            _check_room([bundles[i] for i in todo], total)
            pg = _reserve(ray, [bundles[i] for i in todo])
            where = None if cache_dir is None else str(cache_dir)
            threads = [r.get("torch_threads") or max(1, int(b.get("CPU", 1))) for r, b in zip(res, bundles)]
            args = [(specs[i], str(dtype), where, trust_remote_code, threads[i], opts[i]) for i in todo]
            made = _start_actors(ray, pg, todo, [bundles[i] for i in todo], args)
            _ACTORS.update(_collect(ray, pg, made, keys, names, specs, bundles, cache_dir))
        return [_ACTORS[k] for k in keys]


def _check_room(bundles: list[dict], total: dict) -> None:
    """ConfigError naming every resource the cluster cannot give these bundles."""
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    short = {k: (v, total.get(k, 0.0)) for k, v in need.items() if v > total.get(k, 0.0) + 1e-9}
    if short:
        raise ConfigError(
            "the Ray cluster cannot place these members: "
            + "; ".join(f"{k} needs {v:g}, the cluster has {have:g}" for k, (v, have) in sorted(short.items()))
            + f" (bundles {bundles}). Add nodes with those resources or lower "
            "member_resources (e.g. {'num_cpus': 1, 'num_gpus': 0} on a CPU-only cluster)."
        )


def _reserve(ray, bundles: list[dict]):
    """A placement group holding every bundle (PACK), ready within PLACEMENT_TIMEOUT_S."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        raise ConfigError(
            f"the Ray cluster did not find room for the members within {PLACEMENT_TIMEOUT_S:g} s "
            f"(bundles {bundles}, available {ray.available_resources()}); other "
            "jobs hold the resources, or lower member_resources."
        )
    return pg


def _start_actors(ray, pg, todo: list[int], bundles: list[dict], args: list[tuple]) -> list[tuple]:
    """One MemberActor per member in `todo`, each in its bundle of `pg` (`bundles`, in todo's order)
    and made with its `args` (MemberActor's): (index, actor, info ref)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cls = ray.remote(MemberActor)
    made = []
    for j, (i, b, a) in enumerate(zip(todo, bundles, args)):
        actor = cls.options(
            num_cpus=b.get("CPU", 0),
            num_gpus=b.get("GPU", 0),
            memory=b.get("memory"),
            resources={k: v for k, v in b.items() if k not in ("CPU", "GPU", "memory")} or None,
            max_restarts=MAX_RESTARTS,
            max_task_retries=0,
            name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=j),
        ).remote(*a)
        made.append((i, actor, actor.info.remote()))
    return made


def _collect(ray, pg, made, keys, names, specs, bundles, cache_dir) -> list[tuple]:
    """The started actors as RayMembers, once each has loaded its model; when one fails, every
    actor and the reservation are freed (no half-placed ensemble)."""
    from ray.util.placement_group import remove_placement_group

    placed = []
    try:
        for i, actor, info_ref in made:
            try:
                info = ray.get(info_ref)
            except ray.exceptions.RayActorError as exc:
                raise ConfigError(f"member {names[i]!r} could not load in its Ray actor: {exc}") from exc
            member = RayMember(actor, info, actor_tokenizer(actor, cache_dir), spec=specs[i], resources=bundles[i])
            member.placement_group = pg
            placed.append((keys[i], member))
            log.info("placed %s on a Ray actor (%s, %s)", names[i], info["device"], bundles[i])
    except BaseException:
        for _, actor, _ in made:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
        raise
    return placed


def actor_tokenizer(actor, cache_dir=None):
    """The member's tokenizer, from the files its actor loaded (so the caller needs no model files:
    on a cluster the weights live only where the actors run). Kept in the cache folder by digest,
    written under a lock into a uniquely named folder that is renamed into place when complete."""
    from filelock import FileLock

    from ..members.convert import load_cached_tokenizer
    from ..members.fetch import cache_root

    ray = _ray()
    root = cache_root(cache_dir) / "ray-tokenizers"
    folder = root / ray.get(actor.tokenizer_digest.remote())
    if not (folder / ".complete").is_file():
        root.mkdir(parents=True, exist_ok=True)
        with FileLock(root / f".{folder.name}.lock"):
            if not (folder / ".complete").is_file():
                _write_folder(folder, ray.get(actor.tokenizer_files.remote()))
    return load_cached_tokenizer(folder)


def _write_folder(folder, files: dict[str, bytes]) -> None:
    """`files` (name -> bytes) as `folder`, written into a uniquely named folder beside it, then renamed."""
    import shutil
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".partial"))
    try:
        for name, data in files.items():
            (tmp / Path(name).name).write_bytes(data)  # a bare file name: nothing lands outside the folder
        (tmp / ".complete").write_text("")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(member: RayMember) -> bool:
    ray = _ray()
    try:
        ray.get(member.actor.info.remote(), timeout=30)
        return True
    except Exception:  # noqa: BLE001 - dead for good (restarts used up) or unreachable: place it again
        return False


def clear_actors() -> None:
    """Kill every member actor this process placed (the next ray engine places them again)."""
    ray = _ray()
    from ray.util.placement_group import remove_placement_group

    with _ACTORS_LOCK:
        groups = {}
        for m in _ACTORS.values():
            with contextlib.suppress(Exception):
                ray.kill(m.actor, no_restart=True)
            if m.placement_group is not None:
                groups[m.placement_group.id] = m.placement_group
        for pg in groups.values():
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        _ACTORS.clear()
