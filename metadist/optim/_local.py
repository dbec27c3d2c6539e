"""The owner's side of the distributed optimizer: one local optimizer per (optimizer, owner).

A :class:`LocalOptimizer` holds the owner's parameters, their optimizer state (which leaves the
owner only for ``state_dict``), the gradient-accumulation window and the gradients staged by the
scaler or clipping. Every entry point holds the instance's lock, taken with a timeout, so that
``step`` calls from several trainers are serialized on each owner. The caller reaches it with
:func:`call`, naming the instance by an int key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from metadist.autograd import gradients_here
from metadist.optim.scripting import script_functional_optimizer, torchscript_status

__all__: list[str] = []

logger = logging.getLogger("metadist")

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
# Requests name the local optimizer by an int key, not by its RRef: an RRef argument costs extra
# fork/ack messages on every call. The caller's RRef keeps the object alive; this table is weak.
_LIVE: weakref.WeakValueDictionary[int, LocalOptimizer] = weakref.WeakValueDictionary()
_keys = itertools.count()


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything an owner needs to build its local optimizer, sent once at construction."""

    optimizer_class: type
    functional_class: type | None
    kwargs: dict[str, Any]  # constructor hyperparameters; kernel flags are None when unset
    mode: str
    passes_per_step: int
    average: bool
    timeout: float


def to_functional_hparams(hparams: dict[str, Any]) -> dict[str, float]:
    """Flatten torch param-group scalars into a functional optimizer's ``defaults`` names."""
    out: dict[str, float] = {}
    for key, value in hparams.items():
        if key in TUPLE_KEYS:
            first, second = TUPLE_KEYS[key]
            out[first], out[second] = float(value[0]), float(value[1])
        else:
            out[key] = float(value)
    return out


def eager_kernel(
    accepted: set[str], params: list[Tensor], foreach: bool | None, fused: bool | None
) -> str:
    """Pick ``"fused"``, ``"foreach"`` or ``"single-tensor"`` for an eager functional optimizer.

    ``accepted`` holds the functional class's constructor arguments; ``foreach``/``fused`` are the
    user's flags, ``None`` when unset: only unset flags are auto-picked.
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


@functools.cache
def _log_eager_fallback(name: str, problem: str) -> None:
    # Once per process and class: every owner would otherwise repeat it on every construction.
    logger.warning("metadist: %s; mode='auto' steps %s eagerly", problem, name)


class LocalOptimizer:
    """The optimizer for one owner's share of the parameters."""

    def __init__(self, spec: Spec, params: list[Tensor]) -> None:
        self.spec = spec
        self.params = params
        self.lock = threading.Lock()
        self.accum: list[Tensor | None] | None = None
        self.staged: dict[int, list[Tensor | None]] = {}
        self.optim: Any  # a functional optimizer, its scripted module, or a torch.optim.Optimizer
        functional_class = spec.functional_class
        if functional_class is None:
            if spec.mode == "scripted":
                raise ValueError(
                    f"mode='scripted' needs a functional optimizer registered for "
                    f"{spec.optimizer_class.__name__} (see register_functional_optimizer)"
                )
            self.mode, self.kernel = "torch", "torch.optim"
            self.optim = spec.optimizer_class(params, **spec.kwargs)
            return
        accepted = set(inspect.signature(functional_class.__init__).parameters) - {"self"}  # type: ignore[misc]
        kwargs = {k: v for k, v in spec.kwargs.items() if k in accepted and k != "params"}
        foreach: bool | None = kwargs.pop("foreach", None)
        fused: bool | None = kwargs.pop("fused", None)
        if foreach and fused:
            raise ValueError("fused=True and foreach=True cannot be used together; pick one")
        mode = spec.mode
        if mode == "auto":
            mode = "eager" if "foreach" in accepted or "fused" in accepted else "scripted"
            problem = torchscript_status()[1] if mode == "scripted" else None
            if problem is not None:
                _log_eager_fallback(functional_class.__name__, problem)
                mode = "eager"
        if mode == "scripted" and (foreach or fused):
            raise ValueError(
                "foreach=True / fused=True cannot run under TorchScript; use mode='eager' "
                "for these owners or leave foreach/fused unset"
            )
        self.mode = mode
        self.kernel = "single-tensor"
        if mode == "eager":
            self.kernel = eager_kernel(accepted, params, foreach, fused)
            if self.kernel != "single-tensor":
                kwargs[self.kernel] = True
        functional = functional_class(params, **kwargs)
        self.optim = script_functional_optimizer(functional) if mode == "scripted" else functional

    # -- helpers (called with the lock held) ---------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        timeout = self.spec.timeout
        if not self.lock.acquire(timeout=timeout if timeout > 0 else -1):
            raise TimeoutError(
                f"timed out after {self.spec.timeout}s waiting for this owner's optimizer lock "
                f"on {rpc.get_worker_info().name}"
            )
        try:
            yield
        finally:
            self.lock.release()

    def _gradients(self, context_id: int, apply: bool, pop: bool) -> list[Tensor | None]:
        """The gradients a step of ``context_id`` uses: staged ones, else the context's own
        (with the accumulated window added and averaged when this step applies)."""
        staged = self.staged.pop(context_id, None) if pop else self.staged.get(context_id)
        if staged is not None:
            return staged
        # Empty where this owner took no part in the context's backward pass.
        found = gradients_here(context_id)
        # Tensors hash by identity, so the context's dict is looked up by parameter directly.
        grads: list[Tensor | None] = [found.get(p) for p in self.params]
        if not apply:
            return grads
        if self.accum is not None:
            grads = [
                a if g is None else g if a is None else a + g
                for a, g in zip(self.accum, grads, strict=True)
            ]
        n = self.spec.passes_per_step
        if self.spec.average and n > 1:
            grads = [None if g is None else g / n for g in grads]
        return grads

    def _set_hparams(self, hparams: dict[str, Any]) -> None:
        if self.mode == "torch":
            for group in self.optim.param_groups:
                group.update(hparams)
            return
        flat = to_functional_hparams(hparams)
        current = self.optim.get_defaults() if self.mode == "scripted" else self.optim.defaults
        merged = {k: flat.get(k, v) for k, v in current.items()}
        if self.mode == "scripted":
            self.optim.set_defaults(merged)
        else:
            self.optim.defaults = merged

    def _apply(self, grads: list[Tensor | None]) -> None:
        if self.mode != "torch":
            self.optim.step(grads)
            return
        # Set .grad for exactly the parameters with a gradient in this step and clear it after,
        # so that torch.optim never re-applies a stale .grad from an earlier context.
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g
        try:
            with torch.no_grad():
                self.optim.step()
        finally:
            for p in self.params:
                p.grad = None

    # -- entry points (reached through call()) ------------------------------------------------

    def step(
        self, context_id: int, apply: bool, coef: float, hparams: dict[str, Any] | None
    ) -> None:
        """Accumulate (``apply`` false) or apply the gradients of ``context_id`` times ``coef``;
        ``hparams`` (torch param-group names) is sent only when it changed."""
        with self._locked():
            if hparams is not None:
                self._set_hparams(hparams)
            grads = self._gradients(context_id, apply, pop=True)
            if coef != 1.0:
                grads = [None if g is None else g * coef for g in grads]
            if apply:
                self.accum = None
                self.staged.clear()
                self._apply(grads)
                return
            accum: list[Tensor | None] = self.accum or [None] * len(self.params)
            for i, (a, g) in enumerate(zip(accum, grads, strict=True)):
                if g is not None:
                    accum[i] = g.detach().clone() if a is None else a.add_(g)
            self.accum = accum

    def skip(self) -> None:
        """Drop the window's gradients: some owner found an inf/NaN."""
        with self._locked():
            self.accum = None
            self.staged.clear()

    def stage(
        self, context_id: int, apply: bool, inv_scale: float | None, norm_type: float | None
    ) -> tuple[bool, Tensor | None]:
        """Unscale (by ``inv_scale``) and keep the gradients the next step of ``context_id``
        uses; return whether any is inf/NaN and their norm of order ``norm_type``."""
        with self._locked():
            grads = self._gradients(context_id, apply, pop=False)
            found_inf = False
            if inv_scale is not None:
                grads = [None if g is None else g * inv_scale for g in grads]
                found_inf = any(not bool(torch.isfinite(g).all()) for g in grads if g is not None)
            self.staged[context_id] = grads
            if norm_type is None:
                return found_inf, None
            present = [g for g in grads if g is not None]
            if not present:
                return found_inf, torch.zeros(())
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in present])
            return found_inf, torch.linalg.vector_norm(norms, norm_type)

    def state(self) -> tuple[list[dict[str, Any] | None], list[Tensor | None] | None]:
        """Copies of the optimizer state (one entry per parameter) and of the open window."""
        with self._locked():
            live = self.optim.get_state() if self.mode == "scripted" else self.optim.state
            by_id = {id(p): s for p, s in live.items()}
            states: list[dict[str, Any] | None] = []
            for p in self.params:
                s = by_id.get(id(p))
                states.append({k: _copy(v) for k, v in s.items()} if s else None)
            accum = None if self.accum is None else [_copy(a) for a in self.accum]
            return states, accum

    def load_state(
        self, states: list[dict[str, Any] | None], accum: list[Tensor | None] | None
    ) -> None:
        """Replace the optimizer state and the accumulation window (``None``: a fresh one)."""
        with self._locked():
            for what, given in (("state", states), ("accumulated gradients", accum)):
                if given is not None and len(given) != len(self.params):
                    raise ValueError(
                        f"{what} for {len(given)} parameters sent to an owner of {len(self.params)}"
                    )
            # Convert everything first: a bad state must leave this owner as it was.
            tensors_only = self.mode != "torch"
            new = {
                p: {k: _as_state(v, p, tensors_only) for k, v in s.items()}
                for p, s in zip(self.params, states, strict=True)
                if s
            }
            window = None
            if accum is not None:
                window = [
                    None if a is None else a.detach().to(p.device, p.dtype, copy=True)
                    for p, a in zip(self.params, accum, strict=True)
                ]
            self.accum = (
                window if window is not None and any(a is not None for a in window) else None
            )
            self.staged.clear()
            if self.mode == "scripted":
                self.optim.set_state(new)
            elif self.mode == "torch":
                self.optim.state.clear()
                self.optim.state.update(new)
            else:
                self.optim.state = new

    def describe(self) -> tuple[str, str, int]:
        """``(mode, kernel, number of parameters)``."""
        return self.mode, self.kernel, len(self.params)


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


def _as_state(value: Any, param: Tensor, tensors_only: bool) -> Any:
    if not isinstance(value, Tensor):
        return torch.tensor(value) if tensors_only else value
    # Scalar state ("step") stays where torch keeps it; per-element state follows the param.
    if value.dim() == 0:
        return value.detach().clone()
    return value.detach().to(device=param.device, dtype=param.dtype, copy=True)


# -- module-level functions the caller invokes over RPC (pickled by reference) ----------------


def build(spec: Spec, param_rrefs: list[rpc.RRef[Tensor]]) -> LocalOptimizer:
    """Resolve the RRefs to this owner's tensors, check them and build the local optimizer."""
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
    return LocalOptimizer(spec, params)


def create(spec: Spec, param_rrefs: list[rpc.RRef[Tensor]]) -> tuple[rpc.RRef[LocalOptimizer], int]:
    """Build a local optimizer on this owner (RPC target); return an RRef to it and its key."""
    local = build(spec, param_rrefs)
    key = next(_keys)
    _LIVE[key] = local
    return rpc.RRef(local), key


def call(key: int, method: str, *args: Any) -> Any:
    """Run ``method(*args)`` of the local optimizer ``key`` on this owner (RPC target)."""
    try:
        local = _LIVE[key]
    except KeyError:
        raise RuntimeError(
            f"optimizer {key} no longer exists on {rpc.get_worker_info().name} "
            "(its DistributedOptimizer was garbage-collected)"
        ) from None
    return getattr(local, method)(*args)
