"""The output layer on a few rows, where the CPU's matrix library is slow at them.

A large vocabulary makes the output layer a large matrix (Gemma-3's is 262,144 x 640, 671 MB in
float32). Measured on a 2-core AVX-512 Xeon with the MKL that torch's CPU wheels ship, a product of
that matrix with 4 to 15 rows takes one pass over the weights per 3 rows (8 rows: 90 ms), while
16 rows take a real matrix product (60 ms) and one row 25 ms. Steps of several requests (8 rows),
a SAFE verification of a draft, SpecFuse's scoring of a segment and the shown answers scored for
per-request weights all ask for that many rows. So, on the CPU, a large output layer is timed once
per process and shape (a few hundred ms): where 16 rows cost less than `lo` rows, any product of
`lo` to 15 rows is padded with zero rows to 16, and only the real rows are returned. The rows'
values are those of an unpadded product (up to the float rounding of another kernel's summation
order). A library without the slow path (another CPU, a GPU) is left as it is.

The module's class is swapped for a subclass of its own (`RowPadded`), so its weight (tied to the
input embeddings in many models), hooks and every caller (the model's own forward, `Member.head`)
stay as they were.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch import nn

log = logging.getLogger(__name__)

ROWS = 16  # the row count where the slow path ends (MKL, AVX-512)
MIN_BYTES = 64 << 20  # smaller output layers cost little either way: left unpadded and untimed
_DECISIONS: dict[tuple, int | None] = {}  # (rows, cols, dtype, threads) -> lo (None: no padding)
_LOCK = threading.Lock()


class RowPadded(nn.Linear):
    """An `nn.Linear` whose products of `pad_from` to ROWS - 1 rows run as ROWS rows."""

    pad_from: int = ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // x.shape[-1]
        if not self.pad_from <= n < ROWS:
            return super().forward(x)
        flat = x.reshape(n, x.shape[-1])
        flat = torch.cat([flat, flat.new_zeros(ROWS - n, flat.shape[-1])])
        return super().forward(flat)[:n].reshape(*x.shape[:-1], -1)


def _time(head: nn.Linear, rows: int, repeats: int = 3) -> float:
    """The fastest of `repeats` products of `rows` rows (the first one warms up)."""
    x = torch.zeros(rows, head.in_features, dtype=head.weight.dtype)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            nn.functional.linear(x, head.weight, head.bias)
            best = min(best, time.perf_counter() - t0)
    return best


def measure(head: nn.Linear) -> int | None:
    """The smallest row count of 4 and 7 whose product costs more than 16 rows' by 10%, or None
    (timed once per process, shape, dtype and thread count: about half a second for Gemma-3)."""
    key = (*head.weight.shape, head.weight.dtype, torch.get_num_threads())
    with _LOCK:
        if key not in _DECISIONS:
            t16 = _time(head, ROWS)
            lo = next((r for r in (4, 7) if t16 < 0.9 * _time(head, r)), None)
            _DECISIONS[key] = lo
            log.info("output layer %s: products of %s to %d rows are padded to %d", key[:2], lo, ROWS - 1, ROWS)
    return _DECISIONS[key]


def pad_rows(model, pad_from: int | None = "measure") -> int | None:
    """Pad the output layer of `model` (on the CPU, a plain float `nn.Linear` of at least MIN_BYTES)
    from `pad_from` rows ("measure": what `measure` finds; None: undo). Returns the row count it
    pads from, or None where it does not pad."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.weight.device.type != "cpu" or not head.weight.is_floating_point():
        return None
    if pad_from == "measure":
        if type(head) is RowPadded:
            return head.pad_from
        small = head.weight.numel() * head.weight.element_size() < MIN_BYTES
        if type(head) is not nn.Linear or hasattr(head, "_hf_hook") or small:
            return None  # a quantized subclass, one accelerate hooks, or small enough not to matter
        pad_from = measure(head)
    if pad_from is None:
        if type(head) is RowPadded:
            head.__class__ = nn.Linear
        return None
    head.__class__ = RowPadded
    head.pad_from = int(pad_from)
    return head.pad_from
