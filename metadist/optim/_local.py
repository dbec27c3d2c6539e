"""The owner's side of the distributed optimizer: a :class:`LocalOptimizer` per (optimizer,
owner), one optimizer per param group in it, reached by :func:`call`."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import threading
import weakref
from collections import defaultdict
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from metadist.autograd import gradients_here
from metadist.optim.functional import flat_hparams
from metadist.world import use_process_threads

__all__: list[str] = []

MODES = ("auto", "eager")  # the same now: TorchScript's "scripted" is gone
# Below this mean element count per parameter, torch's multi-tensor kernels beat a per-tensor loop
# on CPU (measured: 100 x 1,000 Adam 1.1 ms vs 1.8 ms; 10 x 100,000 2.6 ms vs 0.9 ms).
FOREACH_MAX_MEAN_NUMEL = 1 << 15
# Picked unasked only for these: on float16 and bfloat16, torch 2.13's fused CPU SGD does not
# step as its per-tensor loop (torch.optim's default) does.
_FUSED_DTYPES = (torch.float32, torch.float64)
# Requests name the local optimizer by an int key, not by its RRef: an RRef argument costs extra
# fork/ack messages on every call. The caller's RRef keeps the object alive; this table is weak.
_LIVE: weakref.WeakValueDictionary[int, LocalOptimizer] = weakref.WeakValueDictionary()
_keys = itertools.count()


@dataclasses.dataclass(frozen=True)
class Spec:
    """What an owner's local optimizer is built with."""

    optimizer_class: type
    functional_class: type | None
    passes_per_step: int
    average: bool
    timeout: float


class TimedLock:
    """A lock whose ``with`` gives up after ``timeout`` seconds (``<= 0``: never); a plain class
    is cheaper than a generator-based context manager."""

    __slots__ = ("lock", "timeout", "what")

    def __init__(self, timeout: float, what: str) -> None:
        self.lock = threading.Lock()
        self.timeout = timeout
        self.what = what

    def __enter__(self) -> None:
        if not self.lock.acquire(timeout=self.timeout if self.timeout > 0 else -1):
            raise TimeoutError(f"timed out after {self.timeout}s waiting for {self.what}")

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def constructor_kwargs(cls: type, hparams: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``hparams`` that ``cls``'s constructor takes (all, if it takes ``**``)."""
    params = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(hparams)
    return {k: v for k, v in hparams.items() if k in params and k != "params"}


def eager_kernel(
    accepted: set[str], params: list[Tensor], foreach: bool | None, fused: bool | None
) -> str:
    """``"fused"``, ``"foreach"`` or ``"single-tensor"`` for a functional class taking
    ``accepted``; only unset (``None``) flags are auto-picked."""
    cpu_floats = all(p.dtype in _FUSED_DTYPES and p.device.type == "cpu" for p in params)
    if "fused" in accepted and (fused or (fused is None and not foreach and cpu_floats)):
        return "fused"
    many_small = len(params) > 1 and sum(p.numel() for p in params) / len(params) <= (
        FOREACH_MAX_MEAN_NUMEL
    )
    if "foreach" in accepted and (foreach or (foreach is None and not fused and many_small)):
        return "foreach"
    return "single-tensor"


class Group:
    """One param group's share of an owner's parameters (``params[start:stop]``), stepped by its
    own optimizer with the group's hyperparameters."""

    def __init__(self, spec: Spec, params: list[Tensor], start: int, hparams: dict[str, Any]):
        self.start, self.stop = start, start + len(params)
        self.optim: Any  # a functional optimizer, or a torch.optim.Optimizer
        cls = spec.functional_class
        if cls is None:
            self.mode, self.kernel = "torch", "torch.optim"
            ctor = constructor_kwargs(spec.optimizer_class, hparams)
            self.optim = spec.optimizer_class([{**hparams, "params": params}], **ctor)
            return
        accepted = set(inspect.signature(cls).parameters)
        kwargs = {k: v for k, v in hparams.items() if k in accepted and k != "params"}
        foreach, fused = kwargs.pop("foreach", None), kwargs.pop("fused", None)
        # (the caller refused foreach=True with fused=True)
        self.mode, self.kernel = "eager", eager_kernel(accepted, params, foreach, fused)
        if self.kernel != "single-tensor":
            kwargs[self.kernel] = True
        self.optim = cls(params, **kwargs)
        # An unasked fused kernel, and how to make the group's optimizer without it.
        self.unfuse: Any = None
        if self.kernel == "fused" and fused is None:
            kwargs.pop("fused")
            self.unfuse = lambda: (eager_kernel(accepted, params, foreach, False), kwargs, cls)

    def _unfused(self, params: list[Tensor]) -> None:
        """From now on the kernel picked as for ``fused=False``: torch's fused kernels take no
        sparse gradient (an embedding's), and torch.optim picks them only when asked. State
        kept."""
        kernel, kwargs, cls = self.unfuse()
        before = self.optim
        self.kernel = kernel
        self.unfuse = None
        self.optim = cls(params, **kwargs, **({kernel: True} if kernel != "single-tensor" else {}))
        self.optim.state = before.state
        self.optim.defaults = before.defaults

    def set(self, name: str, value: Any) -> None:  # (torch.optim keeps its state in a defaultdict)
        setattr(self.optim, name, defaultdict(dict, value) if self.mode == "torch" else value)

    def update(self, hparams: dict[str, Any]) -> None:  # torch's param-group names
        if self.mode == "torch":
            self.optim.param_groups[0].update(hparams)
        else:
            flat = flat_hparams(hparams)
            self.optim.defaults = {k: flat.get(k, v) for k, v in self.optim.defaults.items()}

    def step(self, params: list[Tensor], grads: list[Tensor | None]) -> None:
        if self.mode != "torch":
            if self.unfuse is not None and any(g is not None and g.is_sparse for g in grads):
                self._unfused(params)
            self.optim.step(grads)
            return
        # Set .grad for exactly the parameters with a gradient in this step and clear it after,
        # so that torch.optim never re-applies a stale .grad from an earlier context.
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        try:
            self.optim.step()  # (torch.optim steps under no_grad)
        finally:
            for p in params:
                p.grad = None


class LocalOptimizer:
    """One owner's share of the parameters, its groups, window and staged gradients."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.params: list[Tensor] = []
        self.groups: dict[int, Group] = {}  # by the caller's param-group index
        self.lock = TimedLock(spec.timeout, "this owner's optimizer lock")
        self.accum: list[Tensor | None] | None = None
        self.staged: dict[int, list[Tensor | None]] = {}

    def add(self, index: int, param_rrefs: list[rpc.RRef[Tensor]], hparams: dict[str, Any]) -> None:
        """Add this owner's share of param group ``index``."""
        here = rpc.get_worker_info().name
        params = [r.local_value() for r in param_rrefs]
        if bad := [i for i, value in enumerate(params) if not isinstance(value, Tensor)]:
            kind = type(params[bad[0]]).__name__
            raise TypeError(f"parameter RRef {bad[0]} on {here} holds a {kind}, not a torch.Tensor")
        if len({id(p) for p in [*self.params, *params]}) < len(self.params) + len(params):
            raise ValueError(f"the same tensor is listed twice on {here}; pass each once")
        with self.lock:
            group = Group(self.spec, params, len(self.params), hparams)
            self.params += params
            self.groups[index] = group
            for grads in [self.accum, *self.staged.values()]:
                if grads is not None:
                    grads.extend([None] * len(params))

    def _gradients(self, context_id: int, apply: bool, pop: bool) -> list[Tensor | None]:
        """The gradients a step of ``context_id`` uses: staged ones, else the context's (plus the
        window's, averaged, when it applies)."""
        staged = self.staged.pop(context_id, None) if pop else self.staged.get(context_id)
        if staged is not None:
            return staged
        # Empty where this owner took no part in the backward pass; tensors hash by identity.
        found = gradients_here(context_id)
        grads: list[Tensor | None] = [found.get(p) for p in self.params]
        if not apply:
            return grads
        if self.accum is not None:
            grads = [_add(a, g) for a, g in zip(self.accum, grads, strict=True)]
        n = self.spec.passes_per_step
        if self.spec.average and n > 1:
            grads = [None if g is None else g / n for g in grads]
        return grads

    def step(
        self, context_id: int, apply: bool, coef: float, hparams: dict[int, dict[str, Any]] | None
    ) -> None:
        """Accumulate (``apply`` false) or apply the gradients of ``context_id`` times ``coef``,
        after taking ``hparams``, the groups' changed hyperparameters."""
        with self.lock:
            for index, values in (hparams or {}).items():
                if index in self.groups:
                    self.groups[index].update(values)
            grads = self._gradients(context_id, apply, pop=True)
            if coef != 1.0:
                grads = [None if g is None else g * coef for g in grads]
            if apply:
                self.accum = None
                self.staged.clear()
                for group in self.groups.values():
                    part = slice(group.start, group.stop)
                    group.step(self.params[part], grads[part])
                return
            accum: list[Tensor | None] = self.accum or [None] * len(self.params)
            for i, (a, g) in enumerate(zip(accum, grads, strict=True)):
                if g is not None:
                    accum[i] = g.detach().clone() if a is None else a.add_(g)
            self.accum = accum

    def skip(self) -> None:
        """Drop the window's gradients: some owner found an inf/NaN."""
        with self.lock:
            self.accum = None
            self.staged.clear()

    def stage(
        self, context_id: int, apply: bool, inv_scale: float | None, norm_type: float | None
    ) -> tuple[bool, Tensor | None]:
        """Unscale and keep the gradients the next step of ``context_id`` uses; return whether
        any is inf/NaN, and their norm."""
        with self.lock:
            grads = self._gradients(context_id, apply, pop=False)
            found_inf = False
            if inv_scale is not None:
                grads = [None if g is None else g * inv_scale for g in grads]
                found_inf = any(not bool(torch.isfinite(g).all()) for g in grads if g is not None)
            self.staged[context_id] = grads
            if norm_type is None:
                return found_inf, None
            present = [g for g in grads if g is not None]
            return found_inf, torch.nn.utils.get_total_norm(present, norm_type)

    def state(self) -> tuple[list[dict[str, Any] | None], list[Tensor | None] | None]:
        """Copies of the state (per parameter) and of the window."""
        with self.lock:
            by_id = {id(p): s for g in self.groups.values() for p, s in g.optim.state.items()}
            states = [copy.deepcopy(by_id.get(id(p))) or None for p in self.params]
            return states, copy.deepcopy(self.accum)

    def load_state(
        self, states: list[dict[str, Any] | None], accum: list[Tensor | None] | None
    ) -> None:
        """Replace the state and the window (``None``: a fresh one)."""
        with self.lock:
            # Converted first, lengths checked: a bad state leaves this owner as it was.
            new = {
                index: {
                    p: {k: _as_state(v, p, g.mode != "torch") for k, v in s.items()}
                    for p, s in zip(
                        self.params[g.start : g.stop], states[g.start : g.stop], strict=True
                    )
                    if s
                }
                for index, g in self.groups.items()
            }
            window = [
                None if a is None else a.detach().to(p.device, p.dtype, copy=True)
                for p, a in zip(self.params, accum or [None] * len(states), strict=True)
            ]
            self.accum = window if any(a is not None for a in window) else None
            self.staged.clear()
            for index, group in self.groups.items():
                group.set("state", new[index])

    def describe(self) -> tuple[str, str, int]:
        """``(mode, kernel, number of parameters)``; "+" joins the groups' if they differ."""
        modes, kernels = (
            "+".join(dict.fromkeys(getattr(g, a) for g in self.groups.values()))
            for a in ("mode", "kernel")
        )
        return modes, kernels, len(self.params)


def _add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """``a + b``, where a missing gradient (``None``) adds nothing."""
    if a is None:
        return b
    return a if b is None else a + b


def _as_state(value: Any, param: Tensor, tensors_only: bool) -> Any:
    if not isinstance(value, Tensor):
        return torch.tensor(value) if tensors_only else value
    # Scalar state ("step") stays where torch keeps it; per-element state follows the param.
    if value.dim() == 0:
        return value.detach().clone()
    return value.detach().to(device=param.device, dtype=param.dtype, copy=True)


def add(
    key: int | None, spec: Spec, index: int, rrefs: list[rpc.RRef[Tensor]], hparams: dict[str, Any]
) -> tuple[rpc.RRef[LocalOptimizer] | None, int]:
    """Add this owner's share of param group ``index`` to its local optimizer ``key`` (``None``:
    a new one); return an RRef that keeps a new one alive, and the key (RPC target)."""
    use_process_threads()
    if key is not None:
        _LIVE[key].add(index, rrefs, hparams)
        return None, key
    local = LocalOptimizer(spec)
    local.add(index, rrefs, hparams)
    key = next(_keys)
    _LIVE[key] = local
    return rpc.RRef(local), key


def call(key: int, method: str, *args: Any) -> Any:
    """Run ``method(*args)`` of the local optimizer ``key`` on this owner (RPC target)."""
    use_process_threads()  # an RPC handler thread: its update then runs like the caller's
    try:
        local = _LIVE[key]
    except KeyError:
        raise RuntimeError(
            f"optimizer {key} no longer exists on {rpc.get_worker_info().name} "
            "(its DistributedOptimizer was garbage-collected)"
        ) from None
    return getattr(local, method)(*args)
