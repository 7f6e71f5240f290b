"""Linear layers on a few rows, where the CPU's matrix library is slow at them.

A decode step multiplies every linear layer's weight by as many rows as requests step together
(one row alone; a batched step of 8 requests, 8; a SAFE verification, SpecFuse's scoring of a
segment and the shown answers scored for per-request weights, a few more). With the MKL that
torch's CPU wheels ship, on 2-core AVX-512 machines (an Intel Xeon, an AMD EPYC), `linear(x, W)`
is slow at many of those row counts:
- the output layer (Gemma-3's 262,144 x 640): one row is a matrix-vector product that reads the
  weights well below the memory's speed, 4 to 15 rows take one pass over the weights per 3 rows,
  and 16 rows a real matrix product;
- the layers inside (576 x 576 to 2048 x 640 on the bundled members), on the EPYC: 2 and 3 rows
  cost about twice one row, so a step of 2 requests cost what two steps of one did.
The same product written the other way round, `mm(W, x.T)`, takes 2 to 8 rows in one fast pass.

So, on the CPU, each float `nn.Linear` of a model with at least MIN_IN inputs and MIN_BYTES of
weight is timed once per process and shape: `linear` at 1 to 16 rows, and `mm(W, x.T)` at the
same (a layer of at least BIG bytes: at 4, 8 and 16 rows only, each product there costs tens of
ms). That gives the layer a plan: each row count n up to 16 runs as the cheapest timed product of
at least n rows (padded with zero rows, only the real rows returned) where that costs 10% less
than `linear` at n rows. The rows' values are those of the plain product up to the float rounding
of another kernel's summation order. A library without the slow paths (another CPU, a GPU) gets
no plan. The module's class is swapped for a subclass of its own (`RowPadded`), so its weight
(tied to the input embeddings in many models), hooks and every caller (the model's own forward,
`Member.head`) stay as they were.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch import nn

log = logging.getLogger(__name__)

ROWS = 16  # the plan covers products of 1 to ROWS rows; larger ones run as they are
BUCKETS = (4, 8, 16)  # the padded row counts a BIG layer is timed at
KERNELS = ("linear", "mm")  # linear(x, W); mm(W, x.T).T
MIN_IN = 256  # a layer with fewer inputs is left as it is (the tiny test models' layers)
MIN_BYTES = 256 << 10  # and one with less weight (a product of a few microseconds either way)
BIG = 64 << 20  # a layer this large is timed at fewer row counts (a product costs tens of ms)
TIMING_S = 0.03  # a small layer's product is repeated for up to this long (5 runs at most), the fastest kept
_DECISIONS: dict[tuple, tuple | None] = {}  # (out, in, dtype, bias, threads) -> plan (None: as it is)
_LOCK = threading.Lock()

Plan = tuple  # ROWS entries, for 1..ROWS rows: (rows padded to, kernel), or None for the plain product


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
    """x [n, in] times the layer's weight [out, in]: [n, out], by `kernel`."""
    if kernel == "linear":
        return nn.functional.linear(x, weight, bias)
    out = torch.mm(weight, x.T).T
    return (out + bias if bias is not None else out).contiguous()


class RowPadded(nn.Linear):
    """An `nn.Linear` whose products of 1 to ROWS rows follow `plan`."""

    plan: Plan = (None,) * ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // x.shape[-1]
        step = self.plan[n - 1] if 1 <= n <= ROWS else None
        if step is None:
            return super().forward(x)
        rows, kernel = step
        flat = x.reshape(n, x.shape[-1])
        if rows > n:
            flat = torch.cat([flat, flat.new_zeros(rows - n, flat.shape[-1])])
        return product(flat, self.weight, self.bias, kernel)[:n].reshape(*x.shape[:-1], -1)


def _time(layer: nn.Linear, rows: int, kernel: str, warm: bool = True) -> float:
    """The fastest of a few products of `rows` rows, after one that warms up (`warm`): up to 5, for
    up to TIMING_S (a product longer than that: one)."""
    x = torch.zeros(rows, layer.in_features, dtype=layer.weight.dtype)
    best, start, runs = float("inf"), time.perf_counter(), 0
    with torch.inference_mode():
        if warm:
            product(x, layer.weight, layer.bias, kernel)
        while runs < 5 and (runs == 0 or time.perf_counter() - start < TIMING_S):
            t0 = time.perf_counter()
            product(x, layer.weight, layer.bias, kernel)
            best, runs = min(best, time.perf_counter() - t0), runs + 1
    return best


def plan_from(timings: dict[tuple[int, str], float]) -> Plan | None:
    """The plan from timings {(rows, kernel): seconds}, `linear` at every row count 1..ROWS (module
    docstring). None: nothing pays."""
    plan = []
    for n in range(1, ROWS + 1):
        t, rows, kernel = min((t, b, k) for (b, k), t in timings.items() if b >= n)
        plain_itself = rows == n and kernel == "linear"
        plan.append((rows, kernel) if t <= 0.9 * timings[(n, "linear")] and not plain_itself else None)
    return tuple(plan) if any(plan) else None


def measure(layer: nn.Linear) -> Plan | None:
    """The plan for this layer, timed once per process, shape, dtype and thread count."""
    w = layer.weight
    key = (*w.shape, w.dtype, layer.bias is not None, torch.get_num_threads())
    with _LOCK:
        if key not in _DECISIONS:
            big = w.numel() * w.element_size() >= BIG  # warmed up once: each product reads the weights anew
            timings = {(n, "linear"): _time(layer, n, "linear", n == 1 or not big) for n in range(1, ROWS + 1)}
            for n in BUCKETS if big else range(1, ROWS + 1):
                timings[(n, "mm")] = _time(layer, n, "mm", n == BUCKETS[0] or not big)
            _DECISIONS[key] = plan_from(timings)
            log.info("linear layer %s: %s", key[:2], describe(_DECISIONS[key]))
    return _DECISIONS[key]


def describe(plan: Plan | None) -> str:
    """A plan in words: '1-4 rows as 4 (mm), 7-8 as 8 (mm), 9-16 as 16 (mm)'."""
    if plan is None:
        return "as it is"
    runs: list[list] = []
    for n, step in enumerate(plan, 1):
        if step is not None and runs and runs[-1][2] == step and runs[-1][1] == n - 1:
            runs[-1][1] = n
        elif step is not None:
            runs.append([n, n, step])
    return ", ".join(f"{a}{f'-{b}' if a < b else ''} rows as {s[0]} ({s[1]})" for a, b, s in runs)


def _plannable(layer: nn.Module) -> bool:
    """A float nn.Linear (or one planned already) on the CPU that nothing else wraps (a quantized
    subclass of the layer or of its weight, an accelerate hook), large enough to time."""
    if type(layer) not in (nn.Linear, RowPadded) or hasattr(layer, "_hf_hook"):
        return False
    w = layer.weight
    if type(w) not in (nn.Parameter, torch.Tensor):  # a quantized tensor subclass (torchao's Int8Tensor)
        return False
    return (
        w.device.type == "cpu"
        and w.is_floating_point()
        and w.shape[1] >= MIN_IN
        and w.numel() * w.element_size() >= MIN_BYTES
    )


def check_plan(plan) -> None:
    if len(plan) != ROWS or any(s is not None and (s[0] < n or s[1] not in KERNELS) for n, s in enumerate(plan, 1)):
        raise ValueError(f"a plan has {ROWS} entries, each None or (rows >= its row count, one of {KERNELS})")


def set_plan(layer: nn.Linear, plan: Plan | None) -> None:
    """Give one layer a plan (None: as it is)."""
    if plan is None:
        if type(layer) is RowPadded:
            layer.__class__ = nn.Linear
        return
    check_plan(plan)
    layer.__class__ = RowPadded
    layer.plan = tuple(plan)


def pad_rows(model, plans: dict | None | str = "measure") -> dict[tuple[int, int], Plan]:
    """Give the model's linear layers (those `_plannable`) plans: "measure" (what `measure`
    finds, a layer planned already keeping its own), None (undo), or {(out, in): plan} as this
    returns. Returns the plans that run, by layer shape."""
    out: dict[tuple[int, int], Plan] = {}
    for layer in {id(m): m for m in model.modules() if _plannable(m)}.values():
        shape = tuple(layer.weight.shape)
        if plans == "measure":
            plan = layer.plan if type(layer) is RowPadded else measure(layer)
        else:
            plan = None if plans is None else plans.get(shape)
        set_plan(layer, plan)
        if plan is not None:
            out[shape] = tuple(plan)
    return out
