# RPC targets take their arguments positionally (pickled tuples).
# ruff: noqa: PLR0917
"""The owner's side of the distributed optimizer: one local optimizer per (optimizer, owner).

A :class:`_LocalOptimizer` holds the owner's parameters, the optimizer state for them (state never
leaves the owner except for ``state_dict``), the gradient-accumulation window and the gradients a
caller has staged for unscaling or clipping. Every entry point takes the per-instance lock (with a
timeout), so concurrent ``step`` calls from several trainers are serialized on each owner.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import weakref
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor

from metadist.optim.scripting import script_functional_optimizer

__all__: list[str] = []

MODES = ("auto", "eager", "scripted")
# Tuple-valued torch param-group entries and the names functional classes keep them under.
TUPLE_KEYS = {
    "betas": ("beta1", "beta2"),
    "etas": ("etaminus", "etaplus"),
    "step_sizes": ("step_size_min", "step_size_max"),
}
# Below this mean element count per parameter, torch's multi-tensor kernels beat a per-tensor loop
# on CPU (measured: 100 x 1,000 Adam 1.1 ms vs 1.8 ms; 10 x 100,000 2.6 ms vs 0.9 ms).
FOREACH_MAX_MEAN_NUMEL = 1 << 15
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Per-step requests name the local optimizer by an int key, not by its RRef: sending an RRef as an
# argument costs extra fork/ack messages on every call. The RRef (held by the caller) keeps the
# object alive; this table only holds it weakly.
_LIVE: weakref.WeakValueDictionary[int, _LocalOptimizer] = weakref.WeakValueDictionary()
_keys = itertools.count()


def _ctor_params(cls: type) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self", "params"}  # type: ignore[misc]


def to_functional_hparams(hparams: dict[str, Any]) -> dict[str, float]:
    """Flatten torch param-group scalars into a functional optimizer's ``defaults`` names."""
    out: dict[str, float] = {}
    for key, value in hparams.items():
        if key in TUPLE_KEYS:
            first, second = TUPLE_KEYS[key]
            out[first] = float(value[0])
            out[second] = float(value[1])
        else:
            out[key] = float(value)
    return out


def eager_kernel(
    accepted: set[str], params: list[Tensor], foreach: bool | None, fused: bool | None
) -> str:
    """Pick ``"fused"``, ``"foreach"`` or ``"single-tensor"`` for an eager functional optimizer.

    ``accepted`` holds the functional class's constructor arguments; ``foreach``/``fused`` are the
    user's flags, ``None`` when unset.
    """
    if "fused" in accepted and (
        fused
        or (
            fused is None
            and not foreach
            and all(p.dtype in _FUSED_DTYPES and p.device.type == "cpu" for p in params)
        )
    ):
        return "fused"
    if "foreach" in accepted and (
        foreach
        or (
            foreach is None
            and not fused
            and len(params) > 1
            and sum(p.numel() for p in params) / len(params) <= FOREACH_MAX_MEAN_NUMEL
        )
    ):
        return "foreach"
    return "single-tensor"


class _LocalOptimizer:
    """The optimizer for one owner's share of the parameters."""

    def __init__(
        self,
        optimizer_class: type,
        functional_class: type | None,
        params: list[Tensor],
        ctor_kwargs: dict[str, Any],
        mode: str,
        passes_per_step: int,
        average: bool,
        lock_timeout: float,
    ) -> None:
        self.params = params
        self.passes_per_step = passes_per_step
        self.average = average
        self.lock_timeout = lock_timeout
        self.lock = threading.Lock()
        self.accum: list[Tensor | None] | None = None
        self.staged: dict[int, list[Tensor | None]] = {}
        self.index = {id(p): i for i, p in enumerate(params)}
        self._functional: Any = None
        self._scripted: Any = None
        self._torch_optim: torch.optim.Optimizer | None = None
        if functional_class is None:
            if mode == "scripted":
                raise ValueError(
                    f"mode='scripted' needs a functional optimizer registered for "
                    f"{optimizer_class.__name__} (see register_functional_optimizer)"
                )
            self._torch_optim = optimizer_class(params, **ctor_kwargs)
            self.mode = "torch"
            self.kernel = "torch.optim"
            self._hparams: dict[str, Any] = {}
            return
        accepted = _ctor_params(functional_class)
        kwargs = {k: v for k, v in ctor_kwargs.items() if k in accepted}
        # None means "unset": only unset flags are auto-picked. An explicit False rules that
        # kernel out and an explicit True forces it, as the user asked.
        foreach: bool | None = kwargs.pop("foreach", None)
        fused: bool | None = kwargs.pop("fused", None)
        if foreach and fused:
            raise ValueError("fused=True and foreach=True cannot be used together; pick one")
        fast = "foreach" in accepted or "fused" in accepted
        if mode == "auto":
            mode = "eager" if fast else "scripted"
        if mode == "scripted" and (foreach or fused):
            raise ValueError(
                "foreach=True / fused=True cannot run under TorchScript; use mode='eager' "
                "for these owners or leave foreach/fused unset"
            )
        kernel = "single-tensor"
        if mode == "eager":
            kernel = eager_kernel(accepted, params, foreach, fused)
            if kernel != "single-tensor":
                kwargs[kernel] = True
        self.mode = mode
        self.kernel = kernel
        functional = functional_class(params, **kwargs)
        if mode == "scripted":
            self._scripted = script_functional_optimizer(functional)
        else:
            self._functional = functional
        self._hparams = {}

    # -- helpers (called with the lock held) ------------------------------------------------

    def _acquire(self) -> None:
        if not self.lock.acquire(timeout=self.lock_timeout):
            raise TimeoutError(
                f"timed out after {self.lock_timeout}s waiting for this owner's optimizer lock "
                f"on {rpc.get_worker_info().name}"
            )

    def _context_grads(self, context_id: int) -> list[Tensor | None]:
        try:
            found = dist_autograd.get_gradients(context_id)  # type: ignore[attr-defined]
        except RuntimeError:
            # This owner took no part in the context's backward pass: nothing to apply here.
            return [None] * len(self.params)
        by_id = {id(p): g for p, g in found.items()}
        return [by_id.get(id(p)) for p in self.params]

    def _combined(self, context_id: int, apply: bool) -> list[Tensor | None]:
        grads = self._context_grads(context_id)
        if not apply:
            return grads
        accum = self.accum
        out: list[Tensor | None] = []
        for i, g in enumerate(grads):
            total = g
            if accum is not None and accum[i] is not None:
                total = accum[i] if g is None else accum[i] + g  # type: ignore[operator]
            if total is not None and self.average and self.passes_per_step > 1:
                total = total / self.passes_per_step
            out.append(total)
        return out

    def _set_hparams(self, hparams: dict[str, Any]) -> None:
        if hparams == self._hparams:
            return
        self._hparams = dict(hparams)
        if self._torch_optim is not None:
            for group in self._torch_optim.param_groups:
                group.update(hparams)
            return
        flat = to_functional_hparams(hparams)
        current = self._get_defaults()
        merged = {k: flat.get(k, v) for k, v in current.items()}
        if merged != current:
            if self._scripted is not None:
                self._scripted.set_defaults(merged)
            else:
                self._functional.defaults = merged

    def _get_defaults(self) -> dict[str, float]:
        if self._scripted is not None:
            return dict(self._scripted.get_defaults())
        return dict(self._functional.defaults)

    def _apply(self, grads: list[Tensor | None]) -> None:
        if self._scripted is not None:
            self._scripted.step(grads)
        elif self._functional is not None:
            self._functional.step(grads)
        else:
            assert self._torch_optim is not None
            # Set .grad for exactly the parameters with a gradient in this step and clear the
            # rest, so torch.optim never re-applies a stale .grad from an earlier context.
            for p, g in zip(self.params, grads, strict=True):
                p.grad = g
            try:
                self._torch_optim.step()
            finally:
                for p in self.params:
                    p.grad = None

    # -- RPC entry points ------------------------------------------------------------------

    def step(
        self,
        context_id: int,
        apply: bool,
        hparams: dict[str, Any],
        grad_coef: float,
        skip: bool,
    ) -> None:
        self._acquire()
        try:
            staged = self.staged.pop(context_id, None)
            if skip:
                # Found inf/NaN somewhere: every owner drops this window's gradients.
                self.accum = None
                self.staged.clear()
                return
            if not apply:
                grads = staged if staged is not None else self._context_grads(context_id)
                if self.accum is None:
                    self.accum = [None] * len(self.params)
                for i, g in enumerate(grads):
                    if g is None:
                        continue
                    scaled = g * grad_coef if grad_coef != 1.0 else g
                    acc = self.accum[i]
                    self.accum[i] = scaled.detach().clone() if acc is None else acc.add_(scaled)
                return
            grads = staged if staged is not None else self._combined(context_id, True)
            if grad_coef != 1.0:
                grads = [None if g is None else g * grad_coef for g in grads]
            self.accum = None
            self.staged.clear()
            self._set_hparams(hparams)
            with torch.no_grad():
                self._apply(grads)
        finally:
            self.lock.release()

    def stage(
        self,
        context_id: int,
        apply: bool,
        inv_scale: float | None,
        norm_type: float | None,
    ) -> tuple[bool, Tensor | None]:
        self._acquire()
        try:
            grads = self.staged.get(context_id)
            if grads is None:
                grads = self._combined(context_id, apply)
            found_inf = False
            if inv_scale is not None:
                grads = [None if g is None else g * inv_scale for g in grads]
                found_inf = any(not bool(torch.isfinite(g).all()) for g in grads if g is not None)
            self.staged[context_id] = grads
            norm: Tensor | None = None
            if norm_type is not None:
                present = [g for g in grads if g is not None]
                if present:
                    norm = torch.linalg.vector_norm(
                        torch.stack([torch.linalg.vector_norm(g, norm_type) for g in present]),
                        norm_type,
                    )
                else:
                    norm = torch.zeros(())
            return found_inf, norm
        finally:
            self.lock.release()

    def state(self) -> list[dict[str, Tensor] | None]:
        self._acquire()
        try:
            if self._torch_optim is not None:
                live: Any = self._torch_optim.state
            elif self._scripted is not None:
                live = self._scripted.get_state()
            else:
                live = self._functional.state
            by_id = {id(p): s for p, s in live.items()}
            out: list[dict[str, Tensor] | None] = []
            for p in self.params:
                s = by_id.get(id(p))
                out.append(None if not s else {k: _copy(v) for k, v in s.items()})
            return out
        finally:
            self.lock.release()

    def load_state(self, states: list[dict[str, Any] | None]) -> None:
        self._acquire()
        try:
            if len(states) != len(self.params):
                raise ValueError(
                    f"state for {len(states)} parameters sent to an owner of {len(self.params)}"
                )
            # Convert everything first: a bad state must leave this owner as it was.
            if self._torch_optim is not None:
                copies = {
                    p: {k: _copy(v) for k, v in s.items()}
                    for p, s in zip(self.params, states, strict=True)
                    if s
                }
            else:
                new: dict[Tensor, dict[str, Tensor]] = {}
                for p, s in zip(self.params, states, strict=True):
                    if s:
                        new[p] = {k: _as_state_tensor(v, p) for k, v in s.items()}
            # A load starts a fresh accumulation window on every path (the caller resets its
            # pass count), so gradients accumulated before it are never applied after it.
            self.accum = None
            self.staged.clear()
            if self._torch_optim is not None:
                self._torch_optim.state.clear()
                self._torch_optim.state.update(copies)
                return
            if self._scripted is not None:
                self._scripted.set_state(new)
            else:
                self._functional.state = new
        finally:
            self.lock.release()

    def describe(self) -> tuple[str, str, int]:
        return self.mode, self.kernel, len(self.params)


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


def _as_state_tensor(value: Any, param: Tensor) -> Tensor:
    if isinstance(value, Tensor):
        # Scalar state ("step") stays where torch keeps it; per-element state follows the param.
        if value.dim() == 0:
            return value.detach().clone()
        return value.detach().to(device=param.device, dtype=param.dtype, copy=True)
    return torch.tensor(value)


# -- module-level functions the caller invokes over RPC (picklable by reference) ------------


def new_local_optimizer(
    optimizer_class: type,
    functional_class: type | None,
    param_rrefs: list[rpc.RRef[Tensor]],
    ctor_kwargs: dict[str, Any],
    mode: str,
    passes_per_step: int,
    average: bool,
    lock_timeout: float,
) -> tuple[rpc.RRef[_LocalOptimizer], int]:
    """Create a local optimizer on this owner; return an RRef to it and its lookup key."""
    local = make_local_optimizer(
        optimizer_class,
        functional_class,
        param_rrefs,
        ctor_kwargs,
        mode,
        passes_per_step,
        average,
        lock_timeout,
    )
    key = next(_keys)
    _LIVE[key] = local
    return rpc.RRef(local), key


def _lookup(key: int) -> _LocalOptimizer:
    try:
        return _LIVE[key]
    except KeyError:
        raise RuntimeError(
            f"optimizer {key} no longer exists on {rpc.get_worker_info().name} "
            "(its DistributedOptimizer was garbage-collected)"
        ) from None


def make_local_optimizer(
    optimizer_class: type,
    functional_class: type | None,
    param_rrefs: list[rpc.RRef[Tensor]],
    ctor_kwargs: dict[str, Any],
    mode: str,
    passes_per_step: int,
    average: bool,
    lock_timeout: float,
) -> _LocalOptimizer:
    """Resolve the RRefs to local tensors, check them and build the local optimizer."""
    params: list[Tensor] = []
    seen: set[int] = set()
    for i, rref in enumerate(param_rrefs):
        value = rref.local_value()
        if not isinstance(value, Tensor):
            raise TypeError(
                f"params_rref entry {i} on {rpc.get_worker_info().name} holds a "
                f"{type(value).__name__}, expected a torch.Tensor"
            )
        if id(value) in seen:
            raise ValueError(
                f"params_rref holds the same tensor twice on {rpc.get_worker_info().name}; "
                "pass each parameter once"
            )
        seen.add(id(value))
        params.append(value)
    return _LocalOptimizer(
        optimizer_class,
        functional_class,
        params,
        ctor_kwargs,
        mode,
        passes_per_step,
        average,
        lock_timeout,
    )


def local_step(
    key: int,
    context_id: int,
    apply: bool,
    hparams: dict[str, Any],
    grad_coef: float,
    skip: bool,
) -> None:
    """Step this owner's local optimizer (RPC target)."""
    _lookup(key).step(context_id, apply, hparams, grad_coef, skip)


def local_stage(
    key: int,
    context_id: int,
    apply: bool,
    inv_scale: float | None,
    norm_type: float | None,
) -> tuple[bool, Tensor | None]:
    """Stage (unscale / measure) this owner's gradients of a context (RPC target)."""
    return _lookup(key).stage(context_id, apply, inv_scale, norm_type)


def local_state(key: int) -> list[dict[str, Tensor] | None]:
    """Return copies of this owner's optimizer state, one entry per parameter (RPC target)."""
    return _lookup(key).state()


def local_load_state(key: int, states: list[dict[str, Any] | None]) -> None:
    """Replace this owner's optimizer state (RPC target)."""
    _lookup(key).load_state(states)


def local_describe(key: int) -> tuple[str, str, int]:
    """Return (mode, kernel, number of params) of this owner's optimizer (RPC target)."""
    return _lookup(key).describe()
