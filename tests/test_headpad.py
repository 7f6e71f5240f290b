"""Linear layers' products of a few rows planned where the CPU's library is slow at them
(members/backends/transformers/headpad.py): the same values as the plain product for every row count, shape and kernel;
the model's weights stay tied; the plan from timings; and the real Gemma-3 member's logits
unchanged with every layer planned."""

from unittest import mock

import pytest
import torch
from torch import nn

from ensemble_llm.members.backends.transformers import headpad
from ensemble_llm.members.backends.transformers.headpad import ROWS, RowPadded, describe, pad_rows, plan_from, set_plan

MIXED = tuple([(4, "mm")] * 4 + [None, None] + [(8, "mm")] * 2 + [(16, "linear")] * 7 + [None])


def _spy():
    """Patch the two products to record (kernel, rows) of each call."""
    seen = []
    linear, mm = nn.functional.linear, torch.mm

    def lin(x, w, b=None):
        seen.append(("linear", x.numel() // x.shape[-1]))
        return linear(x, w, b)

    def mm_(a, b):
        seen.append(("mm", b.shape[-1]))
        return mm(a, b)

    return seen, mock.patch("torch.nn.modules.linear.F.linear", lin), mock.patch.object(headpad.torch, "mm", mm_)


@pytest.mark.parametrize("bias", [True, False])
def test_planned_product_equals_the_plain_one_for_every_row_count_and_shape(bias):
    torch.manual_seed(0)
    plain = nn.Linear(24, 300, bias=bias)
    planned = nn.Linear(24, 300, bias=bias)
    planned.load_state_dict(plain.state_dict())
    planned.__class__, planned.plan = RowPadded, MIXED
    seen, p1, p2 = _spy()
    for shape in [(n, 24) for n in range(1, 21)] + [(1, 9, 24), (2, 3, 24), (3, 1, 24), (1, 16, 24), (24,)]:
        x = torch.randn(*shape)
        want = nn.functional.linear(x, plain.weight, plain.bias)
        seen.clear()
        with p1, p2:
            got = planned(x)
        n = x.numel() // 24
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        step = MIXED[n - 1] if n <= ROWS else None
        assert seen == [("linear", n) if step is None else (step[1], step[0])], (shape, seen)


def test_pad_rows_keeps_the_tied_weight_and_the_models_logits(tiny_members, monkeypatch):
    model = tiny_members["gemma"].model
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight is emb.weight  # Gemma ties them
    assert pad_rows(model) == {} and type(head) is nn.Linear  # 32 inputs: too small to be timed or planned
    x = torch.tensor([[2, 10, 20, 30, 40, 50, 60, 70, 80]])
    with torch.inference_mode():
        want = model(input_ids=x).logits
    monkeypatch.setattr(headpad, "MIN_IN", 1)  # plan every layer of the tiny model
    monkeypatch.setattr(headpad, "MIN_BYTES", 0)
    shapes = {tuple(m.weight.shape) for m in model.modules() if type(m) is nn.Linear}
    try:
        assert pad_rows(model, {s: MIXED for s in shapes}) == {s: MIXED for s in shapes}
        assert model.get_output_embeddings() is head and type(head) is RowPadded and head.weight is emb.weight
        assert all(type(m) is RowPadded for m in model.modules() if isinstance(m, nn.Linear))
        seen, p1, p2 = _spy()
        with torch.inference_mode(), p1, p2:
            got = model(input_ids=x).logits
            last = model(input_ids=x, logits_to_keep=1).logits
        assert ("linear", 16) in seen and ("mm", 4) in seen  # the 9 rows ran as 16, the last one as 4
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(last, want[:, -1:], atol=1e-5, rtol=1e-5)
        assert pad_rows(model) == {s: MIXED for s in shapes}  # planned already: as it is
    finally:
        assert pad_rows(model, None) == {}
    assert type(head) is nn.Linear and head.weight is emb.weight
    assert not any(type(m) is RowPadded for m in model.modules())


def test_pad_rows_leaves_small_quantized_and_non_cpu_layers_alone_and_checks_a_plan(tiny_members, monkeypatch):
    model = tiny_members["smol"].model
    assert pad_rows(model) == {} and type(model.get_output_embeddings()) is nn.Linear
    monkeypatch.setattr(headpad, "MIN_IN", 1)
    monkeypatch.setattr(headpad, "MIN_BYTES", 0)
    meta = nn.Sequential(nn.Linear(64, 1 << 20, bias=False, device="meta"))
    assert pad_rows(meta, {(1 << 20, 64): MIXED}) == {}  # not on the CPU
    q = nn.Linear(8, 8)
    q.weight = nn.Parameter(torch.zeros(8, 8, dtype=torch.int8), requires_grad=False)
    assert pad_rows(nn.Sequential(q), {(8, 8): MIXED}) == {} and type(q) is nn.Linear  # not a float weight

    class Quantized(torch.Tensor):  # a weight of a tensor subclass, as torchao's Int8Tensor: no mm of ours
        pass

    sub = nn.Linear(8, 8)
    sub.weight = nn.Parameter(torch.zeros(8, 8).as_subclass(Quantized), requires_grad=False)
    assert pad_rows(nn.Sequential(sub), {(8, 8): MIXED}) == {} and type(sub) is nn.Linear
    hooked = nn.Linear(8, 8)
    hooked._hf_hook = object()  # accelerate's offloading: its forward is not ours to change
    assert pad_rows(nn.Sequential(hooked), {(8, 8): MIXED}) == {} and type(hooked) is nn.Linear
    layer = nn.Linear(8, 8)
    for bad in [MIXED[:-1], ((2, "mm"),) * ROWS, ((16, "gemv"),) * ROWS]:
        with pytest.raises(ValueError, match="plan"):
            set_plan(layer, bad)
    assert type(layer) is nn.Linear


def _timings(plain: dict, mm: dict) -> dict:
    return {(n, "linear"): t for n, t in plain.items()} | {(n, "mm"): t for n, t in mm.items()}


ONE_TO_16 = range(1, ROWS + 1)
# ms: Gemma-3's output layer on a 2-core AMD EPYC (linear at every row count; mm at 4, 8 and 16)
HEAD = (
    {n: t for n, t in zip(ONE_TO_16, [47, 89, 142, 92, 105, 129, 148, 84, 95, 120, 143, 65, 83, 70, 105, 90])},
    {4: 21, 8: 49, 16: 65},
)
# us: SmolLM2's 576 x 576 layer there (mm at every row count)
INNER = (
    {n: 21 if n == 1 else 38 if n == 2 else 55 + n for n in ONE_TO_16},
    {n: 22 if n == 1 else 26 if n == 2 else 33 if n <= 4 else 70 + 4 * n for n in ONE_TO_16},
)


@pytest.mark.parametrize(
    "plain, mm, want",
    [
        (
            *HEAD,
            "1-4 rows as 4 (mm), 5-8 rows as 8 (mm), 9-11 rows as 12 (linear), 13 rows as 16 (mm), "
            "15-16 rows as 16 (mm)",
        ),
        (*INNER, "2 rows as 2 (mm), 3 rows as 3 (mm), 4 rows as 4 (mm)"),
        ({n: 20 + n for n in ONE_TO_16}, {n: 22 + n for n in ONE_TO_16}, "as it is"),  # no slow path
        ({n: 25 if n == 1 else 56 if n < 16 else 30 for n in ONE_TO_16}, {}, "2-15 rows as 16 (linear)"),
    ],
)
def test_the_plan_from_timings(plain, mm, want, monkeypatch):
    assert describe(plan_from(_timings(plain, mm))) == want
    monkeypatch.setattr(headpad, "_DECISIONS", {})
    timed = {"linear": plain, "mm": mm}
    monkeypatch.setattr(headpad, "_time", lambda layer, rows, kernel, warm=True: timed[kernel].get(rows, 1e9))
    layer = nn.Linear(8, 8, bias=False)
    assert describe(headpad.measure(layer)) == want
    monkeypatch.setattr(headpad, "_time", lambda *a: pytest.fail("timed twice"))
    assert describe(headpad.measure(layer)) == want  # once per process and shape


@pytest.mark.real
def test_real_gemma_logits_are_those_of_the_plain_layers(real_dirs):
    from helpers import GEMMA

    from ensemble_llm.members import load_member

    m = load_member(real_dirs[GEMMA], device="cpu", dtype="float32")
    planned = m.row_plans  # what this machine's timing chose
    shapes = {tuple(layer.weight.shape) for layer in m.model.modules() if type(layer) in (nn.Linear, RowPadded)}
    assert set(planned) <= shapes and all(len(p) == ROWS for p in planned.values())
    ids = m.prompt_ids("Q: What is the capital of France?\nA: Paris\nQ: And of Italy?\nA:")
    try:
        for plan in [((4, "mm"),) * 4 + (None,) * 12, ((16, "linear"),) * ROWS, ((16, "mm"),) * ROWS]:
            for n in (1, 3, 12):
                x = torch.tensor([ids[:n]])
                pad_rows(m.model, None)
                with torch.inference_mode():
                    want = m.model(input_ids=x).logits
                assert pad_rows(m.model, {s: plan for s in shapes}) == {s: plan for s in shapes}
                with torch.inference_mode():
                    got = m.model(input_ids=x).logits
                # every layer's rounding, through 18 layers: within 1e-3 of logits of size ~10
                torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
                assert got[0].argmax(-1).tolist() == want[0].argmax(-1).tolist()
    finally:
        pad_rows(m.model, planned)
    assert m.row_plans == planned
