"""metadist.ahead without a world: expectations, bitwise matching, the backward and the walk.

The distributed behaviour (answers travelling with replies, the caller's own partitions, the
fallbacks) is in tests/test_autograd.py, scenarios ``answers_ahead_*``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from metadist import ahead


def test_an_expectation_needs_two_equal_passes() -> None:
    site = ("test_expectation", None, 3)
    ahead.forget(site)
    g = torch.tensor(1.0 / 3.0)
    assert ahead.expected(site, 0) is None
    ahead.note(site, 0, [g])
    assert ahead.expected(site, 0) is None  # one pass is not a habit
    ahead.note(site, 0, [g.clone()])
    assert ahead.expected(site, 0) == (g.item(),)
    assert ahead.expected(site, 1) is None  # per partition
    ahead.note(site, 0, [g * 2])
    assert ahead.expected(site, 0) is None  # changed: two equal passes again
    ahead.note(site, 0, [g * 2])
    assert ahead.expected(site, 0) == ((g * 2).item(),)
    ahead.note(site, 0, [None, g])  # a result that got no gradient
    ahead.note(site, 0, [None, g])
    assert ahead.expected(site, 0) == (None, g.item())
    ahead.note(site, 0, [torch.ones(2)])  # not one element: nothing to expect
    ahead.note(site, 0, [torch.ones(2)])
    assert ahead.expected(site, 0) is None
    ahead.note(site, 0, [g])
    ahead.note(site, 0, [g])
    ahead.forget(site)  # a call not differentiated
    assert ahead.expected(site, 0) is None


def test_the_site_registry_is_bounded() -> None:
    for i in range(ahead.MAX_SITES + 5):
        ahead.note(("test_bounded", i), 0, [torch.tensor(1.0)])
    assert len(ahead._SEEN) <= ahead.MAX_SITES


def test_matching_is_bit_for_bit() -> None:
    third = torch.tensor(1.0 / 3.0)
    assert ahead.same((third.item(),), [third])
    assert ahead.same((third.item(),), [third.item()])
    assert not ahead.same((third.item(),), [torch.nextafter(third, torch.tensor(1.0))])
    assert not ahead.same((0.0,), [torch.tensor(-0.0)])  # -0.0 == 0.0, but not its bits
    assert not ahead.same((math.nan,), [torch.tensor(math.nan)])
    assert ahead.same((None, 1.0), [None, torch.tensor(1.0)])
    assert not ahead.same((None, 1.0), [torch.tensor(0.0), torch.tensor(1.0)])
    assert not ahead.same((1.0,), [torch.ones(2)])
    assert not ahead.same((1.0,), [torch.tensor(1.0, requires_grad=True)])  # create_graph
    assert not ahead.same((1.0,), [torch.tensor(1.0), torch.tensor(1.0)])
    assert not ahead.same(None, [torch.tensor(1.0)])
    half = torch.tensor(0.1, dtype=torch.float16)  # a float64 holds any float16 exactly
    assert ahead.same((half.item(),), [half])


def test_the_backward_is_the_one_a_pass_would_run() -> None:
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(5, 4)
    out = (x @ w).tanh().pow(2).mean()
    g = torch.tensor(0.37)
    found = ahead.backward([out], [w], (g.item(),))
    assert found is not None
    (want,) = torch.autograd.grad(out, [w], g, retain_graph=True)
    assert torch.equal(found[0], want)  # bit for bit
    # The graph is kept: a pass expecting otherwise still runs.
    (other,) = torch.autograd.grad(out, [w], torch.tensor(2.0))
    assert torch.allclose(other, want / 0.37 * 2.0)
    # Not applicable: returns None, and the pass computes it as usual.
    vec = x @ w
    assert ahead.backward([vec], [w], (1.0,)) is None  # not one element
    assert ahead.backward([(x @ w).sum()], [w], (None,)) is None  # no gradient expected
    assert ahead.backward([(x @ w).sum()], [w], (1.0, 1.0)) is None  # another result count
    # A result no pass gives a gradient (logits beside a loss): not ahead, so that the pass
    # frees the graph as a local one does.
    assert ahead.backward([(x @ w).sum(), (x @ w).sin().sum()], [w], (1.0, None)) is None
    assert ahead.backward([torch.tensor(1.0)], [w], (1.0,)) is None  # no graph: it fails


def test_answerable_only_for_plain_leaves_that_are_the_whole_graph() -> None:
    model = nn.Linear(3, 2)
    hidden = torch.randn(2, requires_grad=True)
    x = torch.randn(4, 3)
    params = list(model.parameters())
    assert ahead.answerable(model(x).sum(), params)
    # A tensor the function was not given.
    assert not ahead.answerable((model(x) * hidden).sum(), params)
    assert ahead.answerable((model(x) * hidden).sum(), [*params, hidden])
    # A non-leaf argument: its history may reach another argument (here it does).
    fast = [p - 0.1 * torch.ones_like(p) for p in params]
    out = torch.nn.functional.linear(x, fast[0], fast[1]).sum() + model(x).sum()
    assert not ahead.answerable(out, [*params, *fast])
    # A tensor hook on an argument, as long as it is there.
    handle = params[0].register_hook(lambda g: g * 2)
    assert not ahead.answerable(model(x).sum(), params)
    handle.remove()
    assert ahead.answerable(model(x).sum(), params)
    # A module backward hook on the way.
    hooked = nn.Linear(3, 2)
    hooked.register_full_backward_hook(lambda m, gi, go: None)
    assert not ahead.answerable(hooked(x).sum(), list(hooked.parameters()))


def test_hooks_off_takes_them_off_for_the_block_only() -> None:
    w = torch.ones(3, requires_grad=True)
    order: list[str] = []
    w.register_hook(lambda g: order.append("a") or g * 10)
    w.register_hook(lambda g: order.append("b") or g + 1)
    out = (w * 3).sum()
    with ahead.hooks_off([w]):
        (found,) = torch.autograd.grad(out, [w], retain_graph=True)
    assert found.tolist() == [3.0, 3.0, 3.0]
    assert order == []
    out.backward()
    assert w.grad is not None
    assert w.grad.tolist() == [31.0, 31.0, 31.0]
    assert order == ["a", "b"]
