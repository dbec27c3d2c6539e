"""Functional optimizers vs torch.optim (and QHM vs its written-out rule).

No RPC here: every functional optimizer is stepped directly, 20 steps, with some gradients
``None`` (the parameter must be skipped exactly as torch.optim skips a parameter whose ``.grad``
is ``None``).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from metadist.optim import (
    QHM,
    FunctionalAdadelta,
    FunctionalAdagrad,
    FunctionalAdam,
    FunctionalAdamax,
    FunctionalAdamW,
    FunctionalQHM,
    FunctionalRMSprop,
    FunctionalRprop,
    FunctionalSGD,
    _local,
    get_functional_optimizer,
    register_functional_optimizer,
)

STEPS = 20
SHAPES = [(3, 4), (5,), (2, 2, 2), (1,)]

CASES: list[tuple[type, type, dict[str, Any]]] = [
    (torch.optim.SGD, FunctionalSGD, {"lr": 0.1}),
    (
        torch.optim.SGD,
        FunctionalSGD,
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
    ),
    (
        torch.optim.SGD,
        FunctionalSGD,
        {"lr": 0.05, "momentum": 0.9, "nesterov": True, "maximize": True},
    ),
    (torch.optim.Adam, FunctionalAdam, {"lr": 0.01}),
    (
        torch.optim.Adam,
        FunctionalAdam,
        {"lr": 0.01, "betas": (0.8, 0.99), "amsgrad": True, "weight_decay": 0.1, "maximize": True},
    ),
    # Adam's decoupled weight decay is AdamW's rule: the owner steps torch's AdamW twin.
    (
        torch.optim.Adam,
        FunctionalAdam,
        {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True},
    ),
    (torch.optim.AdamW, FunctionalAdamW, {"lr": 0.01, "amsgrad": True}),
    (torch.optim.AdamW, FunctionalAdamW, {"lr": 0.02, "weight_decay": 0.1, "eps": 1e-6}),
    (
        torch.optim.Adagrad,
        FunctionalAdagrad,
        {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1, "initial_accumulator_value": 0.1},
    ),
    (torch.optim.RMSprop, FunctionalRMSprop, {"lr": 0.01}),
    (
        torch.optim.RMSprop,
        FunctionalRMSprop,
        {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.1, "maximize": True},
    ),
    (torch.optim.Adamax, FunctionalAdamax, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.Adadelta, FunctionalAdadelta, {"lr": 1.0, "rho": 0.8, "weight_decay": 0.1}),
    (torch.optim.Rprop, FunctionalRprop, {"lr": 0.01}),
    (torch.optim.Rprop, FunctionalRprop, {"lr": 0.02, "etas": (0.4, 1.3), "maximize": True}),
]


def _kernels(functional_class: type) -> list[str]:
    accepted = inspect.signature(functional_class.__init__).parameters
    kernels = ["single"]
    if "foreach" in accepted:
        kernels.append("foreach")
    if "fused" in accepted:
        kernels.append("fused")
    return kernels


def _grad_plan(seed: int) -> list[list[torch.Tensor | None]]:
    """Per step, one gradient per parameter; every 4th step skips parameter 1 and 3."""
    gen = torch.Generator().manual_seed(seed)
    plan: list[list[torch.Tensor | None]] = []
    for step in range(STEPS):
        grads: list[torch.Tensor | None] = []
        for i, shape in enumerate(SHAPES):
            if step % 4 == 3 and i in (1, 3):
                grads.append(None)
            else:
                grads.append(torch.randn(shape, generator=gen))
        plan.append(grads)
    return plan


def _make(
    functional_class: type, params: list[torch.Tensor], kwargs: dict[str, Any], kernel: str
) -> Any:
    extra: dict[str, Any] = {}
    if kernel in ("foreach", "fused"):
        extra[kernel] = True
    return functional_class(params, **kwargs, **extra)


@pytest.mark.parametrize(
    ("torch_class", "functional_class", "kwargs", "kernel"),
    [
        pytest.param(t, f, k, kern, id=f"{f.__name__}-{n}-{kern}")
        for n, (t, f, k) in enumerate(CASES)
        for kern in _kernels(f)
    ],
)
def test_functional_matches_torch_optim(
    torch_class: type, functional_class: type, kwargs: dict[str, Any], kernel: str
) -> None:
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    ref_params = [torch.nn.Parameter(t.clone()) for t in init]
    ref = torch_class(ref_params, **kwargs)
    params = [t.clone() for t in init]
    optim = _make(functional_class, params, kwargs, kernel)
    for grads in _grad_plan(1):
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        ref.step()
        optim.step([None if g is None else g.clone() for g in grads])
    for mine, theirs in zip(params, ref_params, strict=True):
        torch.testing.assert_close(mine, theirs.detach(), atol=1e-6, rtol=1e-6)
    # Same state layout as torch.optim (what DistributedOptimizer.state_dict relies on).
    state = optim.state
    for p, ref_p in zip(params, ref_params, strict=True):
        ref_state = ref.state.get(ref_p, {})
        mine_state = state.get(p, {})
        assert set(mine_state) == set(ref_state), (mine_state.keys(), ref_state.keys())
        for key, value in ref_state.items():
            torch.testing.assert_close(mine_state[key], value, atol=1e-6, rtol=1e-6)


def _qhm_reference(
    params: list[torch.Tensor],
    plan: list[list[torch.Tensor | None]],
    lr: float,
    momentum: float,
    nu: float,
    weight_decay: float,
    weight_decay_type: str,
) -> list[torch.Tensor]:
    """QHM written out (Ma & Yarats 2019; qhoptim): a dampened buffer that persists."""
    ps = [p.clone().double() for p in params]
    bufs: list[torch.Tensor | None] = [None] * len(ps)
    for grads in plan:
        for i, g in enumerate(grads):
            if g is None:
                continue
            d = g.double()
            if weight_decay_type == "grad":
                d = d + weight_decay * ps[i]
            else:
                ps[i] = ps[i] * (1.0 - lr * weight_decay)
            buf = bufs[i] if bufs[i] is not None else torch.zeros_like(ps[i])
            buf = momentum * buf + (1.0 - momentum) * d
            bufs[i] = buf
            ps[i] = ps[i] - lr * (nu * buf + (1.0 - nu) * d)
    return [p.float() for p in ps]


@pytest.mark.parametrize("weight_decay_type", ["grad", "direct"])
@pytest.mark.parametrize("kernel", ["single", "foreach", "optimizer"])
def test_qhm_matches_update_rule(weight_decay_type: str, kernel: str) -> None:
    hyper = {"lr": 0.05, "momentum": 0.9, "nu": 0.7, "weight_decay": 0.1}
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    plan = _grad_plan(4)
    expected = _qhm_reference(init, plan, weight_decay_type=weight_decay_type, **hyper)
    if kernel == "optimizer":
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = QHM(params, weight_decay_type=weight_decay_type, **hyper)
        for grads in plan:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.step()
        # The buffer persists: it is the same tensor after 20 steps as after the first.
        assert all("momentum_buffer" in opt.state[p] for p in params)
        got = [p.detach() for p in params]
    else:
        got = [t.clone() for t in init]
        fopt = _make(
            FunctionalQHM,
            got,
            {**hyper, "weight_decay_type": weight_decay_type},
            kernel,
        )
        first_grads = plan[0]
        fopt.step(first_grads)
        buf_after_first = fopt.state[got[0]]["momentum_buffer"]
        for grads in plan[1:]:
            fopt.step(grads)
        assert fopt.state[got[0]]["momentum_buffer"] is buf_after_first
    for mine, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, ref, atol=1e-6, rtol=1e-6)


def test_owner_kernel_choice_is_overridable() -> None:
    """Only flags left unset (None) are auto-picked; an explicit False or True is obeyed.

    The owner-side optimizer needs no RPC to build, so the whole matrix runs in-process.
    """
    small = [torch.zeros(8), torch.zeros(8)]  # CPU floats, mean size small: fused and foreach fit

    def build(cls: type, fcls: type, **kwargs: Any) -> _local.Group:
        params = [t.clone() for t in small]
        return _local.Group(_local.Spec(cls, fcls, 1, True, 10.0), params, 0, kwargs)

    adam = {"lr": 0.1}
    qhm = {"lr": 0.1, "momentum": 0.9, "nu": 0.7}
    cases: list[tuple[type, type, dict[str, Any], str]] = [
        (torch.optim.Adam, FunctionalAdam, {**adam, "foreach": None, "fused": None}, "fused"),
        (
            torch.optim.Adam,
            FunctionalAdam,
            {**adam, "foreach": False, "fused": False},
            "single-tensor",
        ),
        (torch.optim.Adam, FunctionalAdam, {**adam, "fused": False}, "foreach"),
        (torch.optim.Adam, FunctionalAdam, {**adam, "foreach": False}, "fused"),
        (torch.optim.Adam, FunctionalAdam, {**adam, "foreach": True}, "foreach"),
        (torch.optim.Adam, FunctionalAdam, {**adam, "fused": True, "foreach": False}, "fused"),
        (torch.optim.RMSprop, FunctionalRMSprop, {"lr": 0.1}, "foreach"),  # no fused kernel
        (torch.optim.RMSprop, FunctionalRMSprop, {"lr": 0.1, "foreach": False}, "single-tensor"),
        (QHM, FunctionalQHM, {**qhm, "foreach": None}, "foreach"),
        (QHM, FunctionalQHM, {**qhm, "foreach": False}, "single-tensor"),
    ]
    for cls, fcls, kwargs, expected in cases:
        local = build(cls, fcls, **kwargs)
        assert (local.mode, local.kernel) == ("eager", expected), (cls.__name__, kwargs)
        # The functional optimizer really runs that kernel (not just reports it).
        functional = local.optim
        assert bool(getattr(functional, "fused", False)) == (expected == "fused"), kwargs
        assert bool(functional.foreach) == (expected == "foreach"), kwargs
    # The per-tensor loop gives torch.optim's result (explicit False on both flags).
    local = build(torch.optim.Adam, FunctionalAdam, lr=0.1, foreach=False, fused=False)
    ref_params = [torch.nn.Parameter(t.clone()) for t in small]
    ref = torch.optim.Adam(ref_params, lr=0.1, foreach=False, fused=False)
    for grads in (
        [torch.ones(8), torch.arange(8.0)],
        [torch.full((8,), -2.0), torch.ones(8)],
    ):
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g
        ref.step()
        local.step(local.optim.params, list(grads))
    for mine, theirs in zip(local.optim.params, ref_params, strict=True):
        torch.testing.assert_close(mine, theirs.detach(), atol=1e-6, rtol=1e-6)


def test_gradients_are_not_modified() -> None:
    params = [torch.ones(3), torch.ones(2)]
    grads = [torch.full((3,), 2.0), torch.full((2,), -1.0)]
    before = [g.clone() for g in grads]
    FunctionalQHM(params, lr=0.1, momentum=0.5, nu=0.5, weight_decay=0.3).step(list(grads))
    FunctionalSGD(params, lr=0.1, weight_decay=0.3).step(list(grads))
    for g, b in zip(grads, before, strict=True):
        assert torch.equal(g, b)


def test_bad_input_raises_with_names() -> None:
    with pytest.raises(ValueError, match="gradients has 1 entries"):
        FunctionalAdam([torch.zeros(1), torch.zeros(1)]).step([torch.zeros(1)])
    with pytest.raises(ValueError, match="weight_decay_type"):
        QHM(
            [torch.nn.Parameter(torch.zeros(1))],
            lr=0.1,
            momentum=0.9,
            nu=0.7,
            weight_decay_type="l2",
        )
    with pytest.raises(ValueError, match="momentum"):
        QHM([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=1.5, nu=0.7)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        FunctionalSGD([torch.zeros(1)], lr=-1.0)


def test_registry_defaults_and_decorator() -> None:
    assert get_functional_optimizer(torch.optim.Adam) is FunctionalAdam
    assert get_functional_optimizer(QHM) is FunctionalQHM
    assert get_functional_optimizer(torch.optim.NAdam) is None

    class MyOptimizer(torch.optim.SGD):
        pass

    decorated = register_functional_optimizer(MyOptimizer)(FunctionalSGD)
    assert decorated is FunctionalSGD
    assert get_functional_optimizer(MyOptimizer) is FunctionalSGD
    with pytest.raises(TypeError, match="optimizer_class must be a class"):
        register_functional_optimizer("SGD", FunctionalSGD)  # type: ignore[arg-type]
    # Wrong types fail here with the argument named, not later on an owner.
    with pytest.raises(TypeError, match=r"optimizer_class must be a class, got \[1\]"):
        get_functional_optimizer([1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer_class must be a class, got 'Adam'"):
        get_functional_optimizer("Adam")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got the torch\.optim\.Optimizer SGD"):
        register_functional_optimizer(MyOptimizer, torch.optim.SGD)
    with pytest.raises(TypeError, match="must define step"):
        register_functional_optimizer(MyOptimizer, type("NoStep", (), {}))
    assert get_functional_optimizer(MyOptimizer) is FunctionalSGD  # failed calls changed nothing


def test_import_does_not_script() -> None:
    import subprocess
    import sys

    code = (
        "import torch, torch.jit\n"
        "calls = []\n"
        "orig = torch.jit.script\n"
        "torch.jit.script = lambda *a, **k: calls.append(a) or orig(*a, **k)\n"
        "import metadist.optim\n"
        "assert not calls, calls\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_eager_optimizers_import_no_compiler() -> None:
    """Making and stepping every functional class, and checking hyperparameters as torch.optim
    does, import neither torch._dynamo (torch's Optimizer.add_param_group does on its first call)
    nor torch.distributed.optim (FSDP and DTensor): 1-3 s of CPU in every owner's first step."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "import metadist.optim as mo\n"
        "from metadist.optim.functional import checked_group\n"
        "before = set(sys.modules)\n"
        "for cls in (mo.FunctionalSGD, mo.FunctionalAdam, mo.FunctionalAdamW,\n"
        "            mo.FunctionalAdagrad, mo.FunctionalRMSprop, mo.FunctionalAdamax,\n"
        "            mo.FunctionalAdadelta, mo.FunctionalRprop):\n"
        "    fused = ({}, {'fused': True}) if 'fused' in cls.__dataclass_fields__ else ({},)\n"
        "    for kwargs in fused:\n"
        "        p = [torch.ones(3), torch.ones(2)]\n"
        "        cls(p, **kwargs).step([torch.ones(3), None])\n"
        "mo.FunctionalQHM([torch.ones(3)], lr=0.1, momentum=0.9, nu=0.7).step([torch.ones(3)])\n"
        "assert checked_group(torch.optim.Adam, lr=0.1, fused=True)['lr'] == 0.1\n"
        "new = set(sys.modules) - before\n"
        "bad = sorted(m for m in new if m.startswith(('torch._dynamo', 'torch.distributed.optim',\n"
        "    'torch.distributed.fsdp', 'torch.distributed.tensor')))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    ("torch_class", "functional_class", "kwargs"),
    [
        (torch.optim.Adam, FunctionalAdam, {"lr": 0.01, "amsgrad": True}),
        (torch.optim.AdamW, FunctionalAdamW, {"lr": 0.01}),
        (torch.optim.Adam, FunctionalAdam, {"weight_decay": 0.1, "decoupled_weight_decay": True}),
        (torch.optim.Adam, FunctionalAdam, {"weight_decay": 0.1, "maximize": True}),
    ],
)
def test_shared_step_counters(
    torch_class: type, functional_class: type, kwargs: dict[str, Any]
) -> None:
    """Fused Adam steps with torch's kernel called directly, the parameters' step counters one
    tensor: the same bits and state as torch.optim, torch's path for partial steps, state read
    or assigned with a counter per parameter."""
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    ref_params = [torch.nn.Parameter(t.clone()) for t in init]
    ref = torch_class(ref_params, fused=True, **kwargs)
    params = [t.clone() for t in init]
    optim = functional_class(params, fused=True, **kwargs)
    plan: list[list[torch.Tensor | None]] = [
        [torch.randn(s, generator=gen) for s in SHAPES] for _ in range(12)
    ]
    plan[6][1] = plan[6][3] = None  # one partial step, taken by torch's functional kernel
    shared = []
    for grads in plan:
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g
        ref.step()
        optim.step(list(grads))
        shared.append(optim._shared is not None)
    # The first step creates the state; a partial step gives each parameter its own counter
    # back, and as the counts then differ, the rest goes through torch's functional kernel.
    assert shared == [False] + [True] * 5 + [False] * 6, shared
    for mine, theirs in zip(params, ref_params, strict=True):
        assert torch.equal(mine, theirs.detach())
    steps = [optim.state[p]["step"] for p in params]
    assert len({id(s) for s in steps}) == len(params)  # one counter each, as torch keeps them
    for p, ref_p in zip(params, ref_params, strict=True):
        assert set(optim.state.get(p, {})) == set(ref.state.get(ref_p, {}))
        for key, value in ref.state.get(ref_p, {}).items():
            assert torch.equal(optim.state[p][key], value), key
    # Assigning a state (a load) starts afresh; stepping adopts the new state.
    optim.state = {p: {k: v.clone() for k, v in s.items()} for p, s in optim.state.items()}
    for entry in optim.state.values():  # equal counts again: the counters can be shared
        entry["step"] = torch.tensor(12.0)
    assert optim._shared is None
    full = [torch.ones(s) for s in SHAPES]
    before = [p.clone() for p in params]
    optim.step(full)
    assert optim._shared is not None
    assert all(not torch.equal(a, b) for a, b in zip(before, params, strict=True))
    assert all(float(optim.state[p]["step"]) == 13.0 for p in params)
    assert optim._shared is None  # reading the state gave each parameter its counter back


class _UserSGD(torch.optim.SGD):
    """A user's optimizer class whose functional twin takes no foreach/fused."""


class _FunctionalUserSGD:
    def __init__(self, params: list[torch.Tensor], lr: float) -> None:
        self.defaults = {"lr": lr}
        self.params = params
        self.state = torch.jit.annotate(dict[torch.Tensor, dict[str, torch.Tensor]], {})

    def step(self, gradients: list[torch.Tensor | None]) -> None:
        for p, g in zip(self.params, gradients):  # noqa: B905 (TorchScript)
            if g is not None:
                p.sub_(g * self.defaults["lr"])


def test_user_class_steps_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner steps a user's functional class eagerly, and compiles nothing."""
    calls: list[Any] = []
    original = torch.jit.script
    monkeypatch.setattr(torch.jit, "script", lambda *a, **k: calls.append(a) or original(*a, **k))
    spec = _local.Spec(_UserSGD, _FunctionalUserSGD, 1, True, 10.0)
    param = torch.ones(2)
    local = _local.Group(spec, [param], 0, {"lr": 0.5})
    local.step([param], [torch.ones(2)])
    assert (local.mode, local.kernel, calls) == ("eager", "single-tensor", [])
    assert torch.equal(param, torch.full((2,), 0.5))
