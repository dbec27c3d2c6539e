"""The distributed optimizer (parameters and their state stay on their owners), its gradient
clipping and its loss scaler (all owners step or all skip)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from metadist.autograd import check_context
from metadist.optim import _local
from metadist.optim.functional import TUPLE_KEYS, checked_group, get_functional_optimizer
from metadist.world import (
    DEFAULT_TIMEOUT,
    get_worker_name,
    get_worker_names,
    require_rpc,
    resolve_timeout,
    wait_all,
)

__all__ = ["DistributedGradScaler", "DistributedOptimizer", "clip_grad_norm_"]

_KERNEL_FLAGS = ("foreach", "fused")
# rpc.remote returns the C++ PyRRef; rpc.RRef is the typing-friendly Python subclass.
_RREF_TYPES = (rpc.RRef, rpc.PyRRef)  # type: ignore[attr-defined]
_WINDOW = "accumulation"  # the state_dict key of an open accumulation window


def is_number(value: Any, kind: type | tuple[type, ...] = (int, float)) -> bool:
    """Whether ``value`` is an instance of ``kind`` and not a bool."""
    return isinstance(value, kind) and not isinstance(value, bool)


def _check(name: str, value: Any, ok: Any, expected: str, error: type = ValueError) -> None:
    if not ok:
        raise error(f"{name} must be {expected}, got {value!r}")


def _positive(value: Any) -> bool:
    return is_number(value) and value > 0 and math.isfinite(value)


def clip_grad_norm_(
    optimizer: DistributedOptimizer,
    context_id: int,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> Tensor:
    """Clip the gradients ``optimizer.step(context_id)`` applies by their norm over all owners,
    as ``torch.nn.utils.clip_grad_norm_`` does in one process.

    Args:
        optimizer: The :class:`DistributedOptimizer`.
        context_id: A distributed-autograd context id created in this process.
        max_norm: Largest allowed total norm (``> 0``).
        norm_type: Order of the norm, ``> 0`` or ``float("inf")``.
        error_if_nonfinite: Raise if the total norm is inf or NaN.

    Returns:
        The total norm of the gradients before clipping (0-dim tensor).

    Raises:
        TypeError: If ``optimizer`` is not a :class:`DistributedOptimizer`.
        ValueError: On a non-positive ``max_norm`` or ``norm_type`` or an unknown context.
        RuntimeError: If ``error_if_nonfinite`` and the total norm is not finite.
    """
    check_optimizer(optimizer)
    _check("max_norm", max_norm, is_number(max_norm) and max_norm > 0, "a positive number")
    _check("norm_type", norm_type, is_number(norm_type) and norm_type > 0, "> 0 or float('inf')")
    results = optimizer._stage(context_id, norm_type=float(norm_type))
    norms = [n.float() for _, n in results if n is not None]
    previous = optimizer._coef.get(context_id, 1.0)
    total = torch.linalg.vector_norm(torch.stack(norms), float(norm_type)) * previous
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients of context {context_id} is "
            f"{float(total)}; set error_if_nonfinite=False to clip anyway"
        )
    optimizer._coef[context_id] = previous * float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


class DistributedOptimizer(torch.optim.Optimizer):
    """Optimize parameters that live on several workers, each owner stepping its own share.

    A drop-in for ``torch.distributed.optim.DistributedOptimizer`` that is a whole
    ``torch.optim.Optimizer`` (``state`` stays empty). ``step(context_id)`` sends one request per
    owner, which steps its parameters with a gradient in that context by their group's
    hyperparameters with the functional twin of ``optimizer_class``, or the class itself. Example:
    ``docs/optim.md``.

    Args:
        optimizer_class: A ``torch.optim.Optimizer`` subclass or a registered functional class.
        params_rref: RRefs to parameters (leaf tensors on any workers), or param groups: dicts
            ``{"params": [RRefs], "lr": ..., ...}`` whose entries override the defaults.
        *args: Positional hyperparameters for ``optimizer_class`` (after ``params``).
        mode: ``"auto"`` or ``"eager"`` (the same: torch's kernels, called from Python), or
            ``{worker name or rank: mode}``.
        backward_passes_per_step: Accumulate this many contexts' gradients per update.
        average_accumulated: Divide the accumulated gradients by ``backward_passes_per_step``.
        timeout: Seconds per request and owner lock: :data:`metadist.world.DEFAULT_TIMEOUT`
            (the RPC world's timeout), ``None`` (no limit) or a number in [0.001, 2147483.647].
        **kwargs: Keyword hyperparameters for ``optimizer_class``.

    Raises:
        RuntimeError: If RPC is not running.
        TypeError: On an argument of the wrong type (a non-RRef parameter, ...).
        ValueError: On a wrong value (no or duplicated parameters, hyperparameters the class
            rejects, ...). Both before any request.
    """

    def __init__(
        self,
        optimizer_class: type,
        params_rref: Iterable[rpc.RRef[Tensor]] | Iterable[dict[str, Any]],
        *args: Any,
        mode: str | Mapping[str | int, str] = "auto",
        backward_passes_per_step: int = 1,
        average_accumulated: bool = True,
        timeout: float | None = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        require_rpc("DistributedOptimizer")
        cls = optimizer_class
        functional = get_functional_optimizer(cls)
        ok = functional or issubclass(cls, torch.optim.Optimizer)
        expected = "a torch.optim.Optimizer subclass or a registered functional optimizer class"
        _check("optimizer_class", cls, ok, expected, TypeError)
        kinds = (Tensor, Mapping, *_RREF_TYPES)
        ok = isinstance(params_rref, Iterable) and not isinstance(params_rref, kinds)
        _check("params_rref", params_rref, ok, "a list of RRefs or dicts", TypeError)
        if not (groups := list(params_rref)):
            raise ValueError("params_rref is empty; pass at least one parameter RRef")
        n = backward_passes_per_step
        _check("backward_passes_per_step", n, is_number(n, int) and n >= 1, "an int >= 1")
        ok = isinstance(average_accumulated, bool)
        _check("average_accumulated", average_accumulated, ok, "a bool", TypeError)
        _check_mode(mode)
        self.timeout = resolve_timeout(timeout, "metadist.optim.DistributedOptimizer")
        self.optimizer_class = cls
        self._functional = functional
        self.backward_passes_per_step = n
        self.average_accumulated = average_accumulated
        self._spec = _local.Spec(cls, functional, n, average_accumulated, self.timeout)
        self.params_rref: list[rpc.RRef[Tensor]] = []  # every group's, in order
        self._owner_indices: dict[str, list[int]] = {}  # owner -> its indices in params_rref
        self._keys: dict[str, int] = {}  # owner -> its optimizer's key
        self._rrefs: dict[str, Any] = {}  # keep the owners' optimizers alive
        self._owner_groups: list[dict[str, Any]] = []  # each group's values, as owners get them
        self._passes = 0  # backward passes in the open window
        self._coef: dict[int, float] = {}  # context -> clipping coefficient of its step
        self._sent_hparams: list[dict[str, Any]] = []
        self._lock = _local.TimedLock(self.timeout, "the optimizer lock")
        self._me = get_worker_name()
        self._built = False
        # Functional owners auto-pick only kernel flags that are unset (None). A flag the user did
        # not pass (they are keyword-only) is unset whatever the class defaults it to.
        self._passed = set(kwargs) if functional else None
        self._flat = not isinstance(groups[0], Mapping)  # errors then name params_rref[i]
        # torch's constructor sets its attributes and hooks up, and calls add_param_group on each
        # group, which checks it; the groups are sent once all are checked.
        super().__init__(groups, _param_group(cls, functional is cls, args, kwargs))  # type: ignore[arg-type]
        for index in range(len(self.param_groups)):
            self._send(index)
        self._built = True

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "a DistributedOptimizer cannot be pickled or copied: its state lives in optimizers "
            "on the owners, reached by RRef; save state_dict() instead"
        )

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name} of {self.optimizer_class.__name__}{super().__repr__()[len(name) :]}"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Do nothing: gradients live in their distributed-autograd context, never in ``.grad``.

        Args:
            set_to_none: Ignored.
        """

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as ``torch.optim.Optimizer.add_param_group`` does; mid-training, its
        owners step it from the next ``step`` on.

        Args:
            param_group: ``{"params": [RRefs], **hyperparameters}`` (the others: ``defaults``).

        Raises:
            TypeError: If it is not such a dict.
            ValueError: On a parameter already in a group, hyperparameters the class rejects, or
                one that differs from ``defaults`` where the functional twin does not take it.
        """
        index = len(self.param_groups)
        where = "param_group" if self._built else f"params_rref[{index}]"
        ok = isinstance(param_group, Mapping) and "params" in param_group
        _check(where, param_group, ok, "a dict with 'params'", TypeError)
        where = "params_rref" if self._flat and not self._built else f"{where}['params']"
        rrefs = param_group["params"]
        rrefs = [rrefs] if isinstance(rrefs, _RREF_TYPES) else rrefs
        if isinstance(rrefs, (set, Tensor)) or not isinstance(rrefs, Iterable):
            raise TypeError(f"{where} must be a list of RRefs, got {type(rrefs).__name__}")
        if not (rrefs := list(rrefs)):
            raise ValueError(f"{where} is empty; pass at least one parameter RRef")
        seen = {id(r) for r in self.params_rref}
        known = get_worker_names()
        for i, rref in enumerate(rrefs):
            if not isinstance(rref, _RREF_TYPES):
                raise TypeError(f"{where}[{i}] must be an RRef, got {type(rref).__name__}")
            if id(rref) in seen:
                raise ValueError(f"{where}[{i}] is listed twice; pass each parameter once")
            seen.add(id(rref))
            if (owner := rref.owner().name) not in known:
                raise ValueError(f"{where}[{i}] is owned by {owner!r}, not a worker: {known}")
        overrides = {k: v for k, v in param_group.items() if k != "params"}
        group = {**self.defaults, **overrides}
        cls = self.optimizer_class
        twin = self._functional
        if overrides:  # the class's own checks of this group's values
            _param_group(cls, cls is twin, (), _local.constructor_kwargs(cls, group))
        for key, value in overrides.items():
            takes = twin is None or key in inspect.signature(twin).parameters
            if not takes and key in self.defaults and value != self.defaults[key]:
                raise ValueError(
                    f"param group {index} sets {key}={value!r}, but {getattr(twin, '__name__', 0)}"
                    f" takes no {key!r}: it cannot differ from the default, {self.defaults[key]!r}"
                )
        self.param_groups.append({**group, "params": rrefs})
        unset = [] if self._passed is None else _KERNEL_FLAGS
        unset = [k for k in unset if k not in overrides and k not in (self._passed or ())]
        self._owner_groups.append({**group, **dict.fromkeys(unset)})
        for rref in rrefs:
            self._owner_indices.setdefault(rref.owner().name, []).append(len(self.params_rref))
            self.params_rref.append(rref)
        if self._built:
            with self._lock:
                self._send(index)

    def _send(self, index: int) -> None:
        """Send param group ``index`` to its owners (creating an owner's optimizer)."""
        shares: dict[str, list[Any]] = {}
        for rref in self.param_groups[index]["params"]:
            shares.setdefault(rref.owner().name, []).append(rref)
        group = self._owner_groups[index]
        replies = self._fan_out(
            _local.add, lambda o: (self._keys.get(o), self._spec, index, shares[o], group), shares
        )
        for owner, (rref, key) in replies.items():
            self._rrefs.setdefault(owner, rref)
            self._keys[owner] = key
        self._sent_hparams = []  # every group's values go with the next step

    @property
    def next_step_applies(self) -> bool:
        """Whether the next ``step`` updates the parameters (last pass of a window)."""
        return self._passes + 1 >= self.backward_passes_per_step

    def describe(self) -> dict[str, tuple[str, str, int]]:
        """Say what each owner runs.

        Returns:
            ``{worker: (mode, kernel, number of parameters)}``, e.g. ``("eager", "fused", 2)``.
        """
        return self._call_owners("describe")

    def step(self, context_id: int) -> None:  # type: ignore[override]
        """Apply the gradients of ``context_id`` on every owner (one request per owner); with
        ``backward_passes_per_step = N`` the first ``N - 1`` calls of a window only accumulate.

        Args:
            context_id: A distributed-autograd context id created in this process.

        Raises:
            ValueError: If ``context_id`` is not a live context of this process.
            TimeoutError: If an owner's lock could not be taken in ``timeout`` seconds.
            RuntimeError: If a request failed or timed out (with the owner's error).
        """
        args: tuple[Any, ...] = (self, context_id)
        kwargs: dict[str, Any] = {}
        hooks = _global_optimizer_pre_hooks.values()
        for pre_hook in [*hooks, *self._optimizer_step_pre_hooks.values()]:
            result = pre_hook(self, args, kwargs)
            if result is not None and not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"a step pre hook must return None or (args, kwargs): {result}")
            args, kwargs = result or (args, kwargs)
        self._step(*args[1:], **kwargs)
        self._optimizer_step_code()
        hooks = _global_optimizer_post_hooks.values()
        for post_hook in [*self._optimizer_step_post_hooks.values(), *hooks]:
            post_hook(self, args, kwargs)

    # torch's Optimizer wraps a step not marked "hooked" in its hooks and a profiler record, which
    # makes a step over RPC 0.12 ms slower (measured); this one runs torch's hooks itself.
    step.hooked = True  # type: ignore[attr-defined]

    def _step(self, context_id: int) -> None:
        check_context(context_id, "DistributedOptimizer")
        for i, (group, fixed) in enumerate(zip(self.param_groups, self._owner_groups, strict=True)):
            _check_flags(f"param_groups[{i}]", group, _flags(fixed, self.defaults))
        hparams = [_floats(group) for group in self.param_groups]
        with self._lock:
            self._passes += 1
            apply = self._passes >= self.backward_passes_per_step
            coef = self._coef.pop(context_id, 1.0)
            if apply:
                self._passes = 0
                self._coef.clear()
            sent = self._sent_hparams
            changed = {i: h for i, h in enumerate(hparams) if i >= len(sent) or h != sent[i]}
            self._sent_hparams = hparams
        try:
            self._call_owners("step", context_id, apply, coef, changed or None)
        except BaseException:
            self._sent_hparams = []  # some owner may have missed them: send on the next step
            raise

    def skip(self, context_id: int) -> None:
        """Drop the gradients of ``context_id`` and of the accumulation window on every owner
        (what :class:`DistributedGradScaler` does when an owner found an inf/NaN).

        Args:
            context_id: A live distributed-autograd context id of this process, as for ``step``.
        """
        check_context(context_id, "DistributedOptimizer")
        with self._lock:
            self._passes = 0
            self._coef.clear()
        self._call_owners("skip")

    def state_dict(self) -> dict[str, Any]:
        """Gather the owners' state in ``torch.optim``'s format (parameter ``i`` is
        ``params_rref[i]``), running the state-dict hooks as ``torch.optim`` does.

        Returns:
            ``{"state": {i: {name: tensor}}, "param_groups": [{..., "params": [0, ...]}]}``, and
            mid-window ``"accumulation": {"passes": k, "gradients": {i: tensor}}``.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        with self._lock:
            passes = self._passes
            per_owner = self._call_owners("state")
        state: dict[int, dict[str, Any]] = {}
        window: dict[int, Tensor] = {}
        for owner, indices in self._owner_indices.items():
            states, accum = per_owner[owner]
            for i, s, a in zip(indices, states, accum or [None] * len(indices), strict=True):
                if s is not None:
                    state[i] = s
                if a is not None:
                    window[i] = a
        groups = []
        start = 0
        for group in self.param_groups:
            groups.append({**group, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        out: dict[str, Any] = {"state": dict(sorted(state.items())), "param_groups": groups}
        if passes:
            out[_WINDOW] = {"passes": passes, "gradients": dict(sorted(window.items()))}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            out = post_hook(self, out) or out
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Send a :meth:`state_dict` (or a ``torch.optim`` one of the same algorithm and groups)
        back to the owners, with the groups' hyperparameters and the accumulation window (none
        saved: a fresh one), running the load-state-dict hooks as ``torch.optim`` does.

        Args:
            state_dict: The dict to load.

        Raises:
            ValueError: If it does not fit this optimizer (checked before any request).
        """
        _check("state_dict", type(state_dict).__name__, isinstance(state_dict, Mapping), "a dict")
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        groups: Any = state_dict.get("param_groups")
        given: Any = state_dict.get("state")
        ok = isinstance(groups, Sequence) and all(isinstance(g, Mapping) for g in groups)
        _check("state_dict['param_groups']", groups, ok, "a list of dicts")
        _check("state_dict['state']", type(given).__name__, isinstance(given, Mapping), "a dict")
        sizes = [len(g["params"]) for g in self.param_groups]
        got = [len(g.get("params", ())) for g in groups]
        expected = f"{len(sizes)} param group(s) of {sizes} parameters"
        _check("state_dict", got, got == sizes, expected)
        order = {pid: i for i, pid in enumerate(p for g in groups for p in g["params"])}
        for key, value in given.items():
            ok = key in order and isinstance(value, dict)
            expected = f"a dict of state tensors for a parameter 0..{len(order) - 1}"
            _check(f"state_dict['state'][{key!r}]", type(value).__name__, ok, expected)
        window = state_dict.get(_WINDOW)
        w: Any = window
        if window is None:
            w = {}
        elif not isinstance(window, Mapping):
            w = {"passes": None}  # refused below
        passes: Any = w.get("passes", 0)
        grads: Any = w.get("gradients", {})
        ok = (
            isinstance(passes, int)
            and isinstance(grads, Mapping)
            and (window is None or 0 < passes < self.backward_passes_per_step)
            and all(k in order and isinstance(g, Tensor) for k, g in grads.items())
        )
        expected = "{'passes': k, 'gradients': {index: tensor}} with 0 < k < "
        expected += f"backward_passes_per_step ({self.backward_passes_per_step})"
        _check(f"state_dict['{_WINDOW}']", window, ok, expected)
        for i, (saved, fixed) in enumerate(zip(groups, self._owner_groups, strict=True)):
            _check_flags(f"state_dict['param_groups'][{i}]", saved, _flags(fixed, self.defaults))
        states = {order[k]: v for k, v in given.items()}
        accum = {order[k]: g for k, g in grads.items()} if window else None
        chunks = {
            owner: ([states.get(i) for i in mine], accum and [accum.get(i) for i in mine])
            for owner, mine in self._owner_indices.items()
        }
        with self._lock:
            self._call_owners("load_state", per_owner=chunks)
            for group, saved in zip(self.param_groups, groups, strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
            self._passes = passes
            self._sent_hparams = []  # owners get the loaded values
            self._coef.clear()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # The method form, ``opt.clip_grad_norm_(context_id, max_norm, ...)``: the function itself.
    clip_grad_norm_ = clip_grad_norm_

    def _stage(
        self, context_id: int, inv_scale: float | None = None, norm_type: float | None = None
    ) -> list[tuple[bool, Tensor | None]]:
        """Have every owner unscale (by ``inv_scale``) the gradients the next ``step(context_id)``
        applies and keep them for it; per owner: ``(found inf/NaN, their norm or None)``."""
        check_context(context_id, "DistributedOptimizer")
        apply = self.next_step_applies
        return list(self._call_owners("stage", context_id, apply, inv_scale, norm_type).values())

    def _fan_out(self, fn: Callable[..., Any], args: Callable[[str], Any], owners: Any) -> Any:
        """``fn(*args(owner))`` for each of ``owners``: by RPC, concurrently with this process's
        own share, run inline. Raises the first error once every owner has replied."""
        futures = {
            o: rpc.rpc_async(o, fn, args=args(o), timeout=self.timeout)
            for o in owners
            if o != self._me
        }
        results: dict[str, Any] = {}
        error: BaseException | None = None
        if self._me in owners:
            try:
                results[self._me] = fn(*args(self._me))
            except BaseException as exc:  # still collect the owners' replies
                error = exc
        wait_all(futures.values())
        for owner, fut in futures.items():
            try:
                results[owner] = fut.wait()
            except Exception as exc:
                if error is None:
                    error = RuntimeError(f"optimizer request to {owner} failed: {exc}")
                    error.__cause__ = exc
        if error is not None:
            raise error
        return results

    def _call_owners(
        self, method: str, *args: Any, per_owner: Mapping[str, tuple[Any, ...]] | None = None
    ) -> dict[str, Any]:
        """Run ``method`` on every owner's local optimizer (see :meth:`_fan_out`)."""
        return self._fan_out(
            _local.call,
            lambda o: (self._keys[o], method, *(per_owner[o] if per_owner else args)),
            list(self._keys),
        )


def _flags(group: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A group's flags (``nesterov``, ``amsgrad``, ``maximize``, ...): owners build their
    optimizer with them, so they stay what they were when the group was added. Kernel flags
    choose how, not what, and keys the class does not take (a label of the user's) mean
    nothing to the owners: both are left out."""
    return {
        k: v
        for k, v in group.items()
        if k in defaults and k not in _KERNEL_FLAGS and (v is None or isinstance(v, (bool, str)))
    }


def _check_flags(where: str, group: Mapping[str, Any], fixed: Mapping[str, Any]) -> None:
    for key, value in fixed.items():
        if key in group and group[key] != value:
            raise ValueError(
                f"{where}[{key!r}] is {group[key]!r}, but the owners were built with "
                f"{key}={value!r}: flags are fixed when a group is added (floats such as lr "
                f"are not). Build a new DistributedOptimizer for another value"
            )


def _floats(group: Mapping[str, Any]) -> dict[str, Any]:
    """A group's float hyperparameters (tuples of them for :data:`TUPLE_KEYS`), the ones owners
    follow step by step, sent again only when they changed."""
    out: dict[str, Any] = {}
    for key, value in group.items():
        if key in TUPLE_KEYS and isinstance(value, tuple):
            out[key] = tuple(float(v) for v in value)
        elif key not in ("params", "initial_lr") and (
            is_number(value) or (isinstance(value, Tensor) and value.numel() == 1)
        ):
            out[key] = float(value)
    return out


def check_optimizer(optimizer: Any) -> None:
    """Raise ``TypeError`` unless ``optimizer`` is a :class:`DistributedOptimizer`."""
    ok = isinstance(optimizer, DistributedOptimizer)
    _check("optimizer", type(optimizer).__name__, ok, "a metadist DistributedOptimizer", TypeError)


def _check_mode(mode: str | Mapping[str | int, str]) -> None:
    """Refuse a ``mode`` that is not one of :data:`_local.MODES` (all step eagerly now), or a
    mapping of workers (names or ranks) to them."""
    expected = f"one of {_local.MODES} (TorchScript's 'scripted' is gone: torch deprecates it)"
    if isinstance(mode, str):
        _check("mode", mode, mode in _local.MODES, expected)
        return
    _check("mode", mode, isinstance(mode, Mapping), "a str or a mapping worker -> mode")
    for worker, value in mode.items():
        _check(f"mode[{worker!r}]", value, value in _local.MODES, expected)
        try:
            get_worker_name(worker)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"mode names {worker!r}, which is not a worker: {exc}") from None


def _param_group(
    cls: type, functional: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Check the hyperparameters by building ``cls`` (over a probe tensor; a functional class
    over none); return its param group without ``params``."""
    try:
        if functional:
            bound = inspect.signature(cls).bind([], *args, **kwargs)
            bound.apply_defaults()
            group = {k: v for k, v in bound.arguments.items() if k != "params"}
        else:
            group = checked_group(cls, *args, **kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{cls.__name__} rejected args={args!r} kwargs={kwargs!r}: {exc}") from exc
    for flag in ("capturable", "differentiable"):
        why = "(owners step outside autograd and graph capture)"
        _check(flag, group.get(flag), not group.get(flag), f"False for DistributedOptimizer {why}")
    for flag in _KERNEL_FLAGS:
        ok = group.get(flag) is None or isinstance(group[flag], bool)
        _check(flag, group.get(flag), ok, "True, False or None (unset)", TypeError)
    if group.get("foreach") and group.get("fused"):
        raise ValueError("fused=True and foreach=True cannot be used together; pick one")
    if functional:
        try:
            cls([], **group)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{cls.__name__} rejected {group!r}: {exc}") from exc
    return group


class DistributedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (on the CPU) for a :class:`DistributedOptimizer`: ``scale(loss)``,
    backward, ``unscale_`` and :func:`clip_grad_norm_` if clipping, ``step(opt, cid)``,
    ``update()`` (after the applying pass of a window). A complete run: ``docs/optim.md``.

    Args:
        init_scale: Initial scale factor.
        growth_factor: Factor the scale grows by after ``growth_interval`` clean steps.
        backoff_factor: Factor the scale shrinks by after a step with inf/NaN.
        growth_interval: Clean steps between growths.
        enabled: If ``False``, every method is a pass-through (``step`` just steps).

    Raises:
        ValueError: On a non-positive ``init_scale``, ``growth_factor <= 1``,
            ``backoff_factor`` outside ``(0, 1)`` or ``growth_interval < 1``.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        _check("init_scale", init_scale, _positive(init_scale), "a positive finite number")
        ok = is_number(growth_factor) and growth_factor > 1.0
        _check("growth_factor", growth_factor, ok, "a number > 1")
        ok = is_number(backoff_factor) and 0 < backoff_factor < 1.0
        _check("backoff_factor", backoff_factor, ok, "a number in (0, 1)")
        ok = is_number(growth_interval, int) and growth_interval >= 1
        _check("growth_interval", growth_interval, ok, "an int >= 1")
        factors = float(init_scale), float(growth_factor), float(backoff_factor)
        super().__init__("cpu", *factors, growth_interval, enabled)
        self._unscaled: dict[tuple[int, int], bool] = {}  # (optimizer, context) -> found inf
        self._found_inf = False

    def unscale_(self, optimizer: DistributedOptimizer, context_id: int) -> bool:  # type: ignore[override]
        """Unscale on every owner the gradients ``optimizer.step(context_id)`` applies (before
        :func:`clip_grad_norm_`; once per step).

        Args:
            optimizer: The distributed optimizer.
            context_id: A distributed-autograd context id created in this process.

        Returns:
            Whether any owner found an inf/NaN.

        Raises:
            TypeError: If ``optimizer`` is not a :class:`DistributedOptimizer`.
            RuntimeError: If called twice for the same step.
        """
        check_optimizer(optimizer)
        key = (id(optimizer), context_id)
        if key in self._unscaled:
            raise RuntimeError(
                f"unscale_ was already called for context {context_id} since the last step"
            )
        staged = self._enabled and optimizer._stage(context_id, 1.0 / self.get_scale())
        self._unscaled[key] = found = any(f for f, _ in staged or ())
        return found

    def step(self, optimizer: DistributedOptimizer, context_id: int) -> bool:  # type: ignore[override]
        """Step ``optimizer`` unless an owner found an inf/NaN, then all skip (a pass that only
        accumulates just steps: the gradients that get applied are checked).

        Args:
            optimizer: The distributed optimizer.
            context_id: A distributed-autograd context id created in this process.

        Returns:
            Whether the owners updated their parameters.

        Raises:
            TypeError: If ``optimizer`` is not a :class:`DistributedOptimizer`.
        """
        check_optimizer(optimizer)
        key = (id(optimizer), context_id)
        if not self._enabled or (not optimizer.next_step_applies and key not in self._unscaled):
            self._unscaled.pop(key, None)
            optimizer.step(context_id)
            return not self._enabled
        if key not in self._unscaled:
            self.unscale_(optimizer, context_id)
        if self._unscaled.pop(key):
            self._found_inf = True
            optimizer.skip(context_id)
            return False
        optimizer.step(context_id)
        return True

    def update(self, new_scale: float | None = None) -> None:  # type: ignore[override]
        """Back the scale off after an inf/NaN, or grow it after ``growth_interval`` clean steps
        (torch's rule).

        Args:
            new_scale: Set this scale instead (resets the growth tracker).

        Raises:
            ValueError: If ``new_scale`` is not a positive finite number.
        """
        if not self._enabled:
            return
        if new_scale is not None:
            _check("new_scale", new_scale, _positive(new_scale), "a positive finite number")
        if self._scale is None:  # nothing scaled yet
            self._lazy_init_scale_growth_tracker(torch.device("cpu"))
        # What torch's update reads: the steps since the last update found an inf or did not.
        found = torch.tensor(float(self._found_inf))
        self._per_optimizer_states[0]["found_inf_per_device"] = {"cpu": found}
        super().update(None if new_scale is None else float(new_scale))
        if new_scale is not None:
            self._growth_tracker.zero_()  # type: ignore[union-attr]
        self._unscaled.clear()
        self._found_inf = False
