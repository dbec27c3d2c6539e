"""Bad input to metadist.optim fails before any request, naming the argument (see _bad_input)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from _bad_input import Row, table_test

from metadist.optim import (
    QHM,
    DistributedGradScaler,
    DistributedOptimizer,
    clip_grad_norm_,
    register_functional_optimizer,
)


def _opt(fx: SimpleNamespace, *args: Any, cls: type = torch.optim.SGD, **kwargs: Any) -> object:
    kwargs.setdefault("lr", 0.1)
    return DistributedOptimizer(cls, *args, **kwargs)


ROWS = [
    Row(
        "optimizer_class str",
        lambda fx: _opt(fx, fx.rrefs, cls="SGD"),
        TypeError,
        r"optimizer_class",
    ),  # type: ignore[arg-type]
    Row("params_rref one RRef", lambda fx: _opt(fx, fx.rrefs[0]), TypeError, r"params_rref"),
    Row("params_rref tensor", lambda fx: _opt(fx, torch.zeros(3)), TypeError, r"params_rref"),
    Row("params_rref empty", lambda fx: _opt(fx, []), ValueError, r"params_rref is empty"),
    # Parameter lists mixing owners incorrectly: a local tensor among RRefs, a nested list, the
    # same RRef twice, an RRef whose owner is another list entry's duplicate.
    Row(
        "params_rref local among remote",
        lambda fx: _opt(fx, [fx.rrefs[0], fx.local, fx.rrefs[1]]),
        TypeError,
        r"params_rref\[1\] must be an RRef",
    ),
    Row(
        "params_rref nested",
        lambda fx: _opt(fx, [fx.rrefs[:1], fx.rrefs[1]]),
        TypeError,
        r"params_rref\[0\] must be an RRef",
    ),
    Row(
        "params_rref duplicate",
        lambda fx: _opt(fx, [fx.rrefs[0], fx.rrefs[1], fx.rrefs[0]]),
        ValueError,
        r"params_rref\[2\] is listed twice",
    ),
    Row("lr negative", lambda fx: _opt(fx, fx.rrefs, lr=-1.0), ValueError, r"learning rate|lr"),
    Row("lr str", lambda fx: _opt(fx, fx.rrefs, lr="big"), ValueError, r"lr"),
    Row("unknown kwarg", lambda fx: _opt(fx, fx.rrefs, lrr=0.1), ValueError, r"lrr"),
    Row(
        "QHM nu",
        lambda fx: _opt(fx, fx.rrefs, cls=QHM, momentum=0.9, nu="x"),
        ValueError,
        r"nu",
    ),
    Row(
        "capturable",
        lambda fx: _opt(fx, fx.rrefs, cls=torch.optim.Adam, capturable=True),
        ValueError,
        r"capturable",
    ),
    Row("mode unknown", lambda fx: _opt(fx, fx.rrefs, mode="fast"), ValueError, r"mode.*'fast'"),
    Row("mode type", lambda fx: _opt(fx, fx.rrefs, mode=3), ValueError, r"mode"),
    Row(
        "mode value",
        lambda fx: _opt(fx, fx.rrefs, mode={"worker1": "turbo"}),
        ValueError,
        r"mode\['worker1'\].*'turbo'",
    ),
    Row(
        "mode unknown worker",
        lambda fx: _opt(fx, fx.rrefs, mode={"ghost": "eager"}),
        ValueError,
        r"mode.*'ghost'",
    ),
    Row(
        "mode scripted (removed)",
        lambda fx: _opt(fx, fx.rrefs, cls=torch.optim.NAdam, mode={"worker1": "scripted"}),
        ValueError,
        r"mode\['worker1'\] must be one of .*TorchScript's 'scripted' is gone",
    ),
    Row(
        "backward_passes_per_step 0",
        lambda fx: _opt(fx, fx.rrefs, backward_passes_per_step=0),
        ValueError,
        r"backward_passes_per_step",
    ),
    Row(
        "backward_passes_per_step str",
        lambda fx: _opt(fx, fx.rrefs, backward_passes_per_step="2"),
        ValueError,
        r"backward_passes_per_step",
    ),
    Row("timeout 0", lambda fx: _opt(fx, fx.rrefs, timeout=0), ValueError, r"between 0.001 and"),
    Row("timeout 1e4 days", lambda fx: _opt(fx, fx.rrefs, timeout=8.64e8), ValueError, r"timeout"),
    Row("timeout inf", lambda fx: _opt(fx, fx.rrefs, timeout=float("inf")), ValueError, r"timeout"),
    Row(
        "step unknown context",
        lambda fx: fx.opt.step(987654321),
        ValueError,
        r"context_id 987654321",
    ),
    Row("step context str", lambda fx: fx.opt.step("1"), ValueError, r"context_id"),
    Row("step context None", lambda fx: fx.opt.step(None), ValueError, r"context_id"),
    Row("skip unknown context", lambda fx: fx.opt.skip(987654321), ValueError, r"context_id"),
    Row(
        "load_state_dict list",
        lambda fx: fx.opt.load_state_dict([]),
        ValueError,
        r"state_dict must be a dict",
    ),
    Row(
        "load_state_dict keys",
        lambda fx: fx.opt.load_state_dict({"state": {}}),
        ValueError,
        r"state_dict.*param_groups",
    ),
    Row(
        "load_state_dict size",
        lambda fx: fx.opt.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]}),
        ValueError,
        r"state_dict must be 1 param group\(s\) of \[2\] parameters, got \[1\]",
    ),
    Row(
        "load_state_dict index",
        lambda fx: fx.opt.load_state_dict({"state": {7: {}}, "param_groups": [{"params": [0, 1]}]}),
        ValueError,
        r"state_dict\['state'\].*7",
    ),
    Row(
        "param group without params",
        lambda fx: _opt(fx, [{"lr": 0.1}]),
        TypeError,
        r"params_rref\[0\] must be a dict with 'params'",
    ),
    Row(
        "param group after a list",
        lambda fx: _opt(fx, [{"params": fx.rrefs[:1]}, fx.rrefs[1]]),
        TypeError,
        r"params_rref\[1\] must be a dict with 'params'",
    ),
    Row(
        "param group set",
        lambda fx: _opt(fx, [{"params": set(fx.rrefs)}]),
        TypeError,
        r"params_rref\[0\]\['params'\] must be a list of RRefs, got set",
    ),
    Row(
        "param group lr negative",
        lambda fx: _opt(fx, [{"params": fx.rrefs[:1]}, {"params": fx.rrefs[1:], "lr": -1.0}]),
        ValueError,
        r"Invalid learning rate",
    ),
    Row(
        "param in two groups",
        lambda fx: _opt(fx, [{"params": fx.rrefs[:1]}, {"params": fx.rrefs[:1]}]),
        ValueError,
        r"params_rref\[1\]\['params'\]\[0\] is listed twice",
    ),
    Row(
        "add_param_group overlap",
        lambda fx: fx.opt.add_param_group({"params": fx.rrefs[1:]}),
        ValueError,
        r"param_group\['params'\]\[0\] is listed twice",
    ),
    Row(
        "add_param_group tensor",
        lambda fx: fx.opt.add_param_group({"params": [fx.local]}),
        TypeError,
        r"param_group\['params'\]\[0\] must be an RRef, got Parameter",
    ),
    Row(
        "add_param_group",
        lambda fx: fx.opt.add_param_group({"params": []}),
        ValueError,
        r"param_group\['params'\] is empty",
    ),
    Row(
        "clip optimizer",
        lambda fx: clip_grad_norm_(torch.optim.SGD([fx.local], lr=0.1), fx.cid, 1.0),  # type: ignore[arg-type]
        TypeError,
        r"optimizer must be a metadist DistributedOptimizer",
    ),
    Row("clip max_norm", lambda fx: clip_grad_norm_(fx.opt, fx.cid, -1.0), ValueError, r"max_norm"),
    Row(
        "clip max_norm str",
        lambda fx: clip_grad_norm_(fx.opt, fx.cid, "1"),
        ValueError,
        r"max_norm",
    ),
    Row(
        "clip norm_type",
        lambda fx: clip_grad_norm_(fx.opt, fx.cid, 1.0, norm_type=0),
        ValueError,
        r"norm_type",
    ),
    Row(
        "clip unknown context",
        lambda fx: clip_grad_norm_(fx.opt, 987654321, 1.0),
        ValueError,
        r"context_id 987654321",
    ),
    Row(
        "scaler init_scale",
        lambda fx: DistributedGradScaler(init_scale=-1.0),
        ValueError,
        r"init_scale",
    ),
    Row(
        "scaler init_scale str",
        lambda fx: DistributedGradScaler(init_scale="big"),
        ValueError,
        r"init_scale",
    ),
    Row(
        "scaler growth_factor",
        lambda fx: DistributedGradScaler(growth_factor=1.0),
        ValueError,
        r"growth_factor",
    ),
    Row(
        "scaler backoff_factor",
        lambda fx: DistributedGradScaler(backoff_factor=2.0),
        ValueError,
        r"backoff_factor",
    ),
    Row(
        "scaler growth_interval",
        lambda fx: DistributedGradScaler(growth_interval=0),
        ValueError,
        r"growth_interval",
    ),
    Row("scaler scale", lambda fx: fx.scaler.scale(3.0), ValueError, r"outputs must be a Tensor"),
    Row(
        "scaler step optimizer",
        lambda fx: fx.scaler.step(torch.optim.SGD([fx.local], lr=0.1), fx.cid),
        TypeError,
        r"optimizer",
    ),
    Row(
        "scaler step context",
        lambda fx: fx.scaler.step(fx.opt, 987654321),
        ValueError,
        r"context_id 987654321",
    ),
    Row(
        "scaler unscale_ context",
        lambda fx: fx.scaler.unscale_(fx.opt, 987654321),
        ValueError,
        r"context_id 987654321",
    ),
    Row("scaler update", lambda fx: fx.scaler.update(-2.0), ValueError, r"new_scale"),
    Row(
        "register class",
        lambda fx: register_functional_optimizer("SGD", object),
        TypeError,
        r"optimizer_class",
    ),
    Row(
        "register functional",
        lambda fx: register_functional_optimizer(torch.optim.SGD, "F"),
        TypeError,
        r"functional_class",
    ),
]


test_bad_call_fails_fast_and_names_the_argument = table_test(__name__, ROWS)
