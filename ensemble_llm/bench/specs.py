"""Which methods a bench runs (floor 5): `--methods` items parsed into `MethodSpec`s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import ConfigError

# the defaults of `ensemble-llm bench`: about 35 minutes for the bundled pair on 2 CPU cores
DEFAULT_METHODS = ("single", "unite", "safe", "specfuse", "smc:n_particles=4")


@dataclass
class MethodSpec:
    label: str
    method: str
    config: dict[str, Any] = field(default_factory=dict)
    members: list[str] | None = None  # None: the run's models


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_methods(specs: Sequence[str], n_members: int) -> list[MethodSpec]:
    """'single' (one per member), 'single:member=1', 'smc:f=min,n_particles=4', 'safe', ..."""
    from ..methods import get_method  # here, not at import: the CLI reads DEFAULT_METHODS without torch

    out: list[MethodSpec] = []
    for spec in specs:
        name, _, rest = spec.partition(":")
        get_method(name)  # names the valid methods when unknown
        cfg: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            key, eq, val = item.partition("=")
            if not eq:
                raise ConfigError(f"method option {item!r} in {spec!r} must look like key=value")
            cfg[key.strip()] = _value(val.strip())
        if name == "single" and "member" not in cfg:
            out += [MethodSpec(f"single-{i}", "single", {"member": i}) for i in range(n_members)]
            continue
        label = name + (":" + ",".join(f"{k}={v}" for k, v in cfg.items()) if cfg else "")
        if name == "single":
            label = f"single-{cfg['member']}"
        out.append(MethodSpec(label, name, cfg))
    if not out:
        raise ConfigError("no methods to benchmark; give at least one, e.g. --methods single safe")
    return out
