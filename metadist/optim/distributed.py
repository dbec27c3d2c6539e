"""The distributed optimizer: parameters stay on their owners, and so does the optimizer state."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from metadist.autograd import check_context
from metadist.optim import _local
from metadist.optim.functional import TUPLE_KEYS, get_functional_optimizer
from metadist.optim.scripting import torchscript_status
from metadist.world import get_worker_name, get_worker_names, require_rpc, wait_all

__all__ = ["DistributedOptimizer", "clip_grad_norm_"]

_KERNEL_FLAGS = ("foreach", "fused")
# rpc.remote returns the C++ PyRRef; rpc.RRef is the typing-friendly Python subclass.
_RREF_TYPES = (rpc.RRef, rpc.PyRRef)  # type: ignore[attr-defined]
_WINDOW = "accumulation"  # the state_dict key of an open accumulation window


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
    if not is_number(max_norm) or not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    if not is_number(norm_type) or not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 or float('inf'), got {norm_type!r}")
    results = optimizer.stage_gradients(context_id, norm_type=float(norm_type))
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
        mode: ``"auto"``, ``"eager"``, ``"scripted"``, or ``{worker name or rank: mode}``.
        backward_passes_per_step: Accumulate this many contexts' gradients per update.
        average_accumulated: Divide the accumulated gradients by ``backward_passes_per_step``.
        timeout: Seconds per request and owner lock; ``None``: the RPC world's timeout.
        **kwargs: Keyword hyperparameters for ``optimizer_class``.

    Raises:
        RuntimeError: If RPC is not running, or ``mode="scripted"`` where torch cannot script.
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
        timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        require_rpc("DistributedOptimizer")
        functional = get_functional_optimizer(optimizer_class)  # checks it is a class
        if functional is None and not issubclass(optimizer_class, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass or a registered "
                f"functional optimizer class, got {optimizer_class!r}"
            )
        kinds = (Tensor, Mapping, *_RREF_TYPES)
        if isinstance(params_rref, kinds) or not isinstance(params_rref, Iterable):
            raise TypeError(f"params_rref must be a list of RRefs or dicts, got {params_rref!r}")
        if not (groups := list(params_rref)):
            raise ValueError("params_rref is empty; pass at least one parameter RRef")
        if not is_number(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
            )
        if not isinstance(average_accumulated, bool):
            raise TypeError(f"average_accumulated must be a bool, got {average_accumulated!r}")
        if timeout is None:
            timeout = rpc.get_rpc_timeout()  # type: ignore[attr-defined]
        elif not (is_number(timeout) and timeout > 0 and math.isfinite(timeout)):
            raise ValueError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        self._modes = _resolve_modes(mode, get_worker_names())
        scripted = functional and "scripted" in self._modes.values()
        if scripted and not (status := torchscript_status(functional))[0]:
            raise RuntimeError(
                f"mode='scripted' needs TorchScript: {status[1]}. Use mode='eager' (or "
                "'auto'), which steps the same functional optimizer without compiling it"
            )
        self.optimizer_class, self._functional = optimizer_class, functional
        self.backward_passes_per_step, self.timeout = backward_passes_per_step, float(timeout)
        self.average_accumulated = average_accumulated
        self._spec = _local.Spec(
            optimizer_class, functional, "", backward_passes_per_step, average_accumulated, timeout
        )
        self.params_rref: list[rpc.RRef[Tensor]] = []  # every group's, in order
        self._owner_indices: dict[str, list[int]] = {}  # owner -> its indices in params_rref
        self._keys: dict[str, int] = {}  # owner -> its optimizer's key (once built)
        self._rrefs: dict[str, Any] = {}  # keep the owners' optimizers alive
        self._owner_groups: list[dict[str, Any]] = []  # the groups' values, as owners get them
        self._passes, self._coef = 0, dict[int, float]()
        self._sent_hparams: list[dict[str, Any]] | None = None
        self._lock = _local.TimedLock(self.timeout, "the optimizer lock")
        self._me = get_worker_name()
        # Functional owners auto-pick only kernel flags that are unset (None). A flag the user did
        # not pass is unset whatever the class defaults it to.
        self._passed = _passed_names(optimizer_class, args, kwargs) if functional else None
        self._flat = not isinstance(groups[0], Mapping)  # errors then name params_rref[i]
        defaults = _param_group(optimizer_class, functional is optimizer_class, args, kwargs)
        # torch's constructor sets its attributes and calls add_param_group on each group (which
        # checks it and sends nothing before all are checked).
        super().__init__(groups, defaults)  # type: ignore[arg-type]
        self._build(range(len(self.param_groups)))

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "a DistributedOptimizer cannot be pickled or copied: its state lives in optimizers "
            "on the owners, reached by RRef; save state_dict() instead"
        )

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name} of {self.optimizer_class.__name__}{super().__repr__()[len(name) :]}"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Do nothing: gradients live in their distributed-autograd context, never in ``.grad``,
        so no step applies a gradient computed before it (drop a window with :meth:`skip`).

        Args:
            set_to_none: Ignored, as there is no ``.grad`` to clear.
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
        where = "param_group" if self._keys else f"params_rref[{index}]"
        if not isinstance(param_group, Mapping) or "params" not in param_group:
            raise TypeError(f"{where} must be a dict with 'params', got {param_group!r:.80}")
        where = "params_rref" if self._flat and not self._keys else f"{where}['params']"
        rrefs = param_group["params"]
        rrefs = [rrefs] if isinstance(rrefs, _RREF_TYPES) else rrefs
        if isinstance(rrefs, (set, Tensor)) or not isinstance(rrefs, Iterable):
            raise TypeError(f"{where} must be a list of RRefs, got {type(rrefs).__name__}")
        if not (rrefs := list(rrefs)):
            raise ValueError(f"{where} is empty; pass at least one parameter RRef")
        seen, known = {id(r) for r in self.params_rref}, get_worker_names()
        for i, rref in enumerate(rrefs):
            if not isinstance(rref, _RREF_TYPES):
                raise TypeError(f"{where}[{i}] must be an RRef, got {type(rref).__name__}")
            if id(rref) in seen:
                raise ValueError(f"{where}[{i}] is listed twice; pass each parameter once")
            seen.add(id(rref))
            if (owner := rref.owner().name) not in known:
                raise ValueError(f"{where}[{i}] is owned by {owner!r}, not a worker: {known}")
        overrides = {k: v for k, v in param_group.items() if k != "params"}
        group, cls = {**self.defaults, **overrides}, self.optimizer_class
        if overrides:  # the class's own checks of this group's values
            _param_group(cls, cls is self._functional, (), _local.constructor_kwargs(cls, group))
        twin = self._functional or cls
        accepted = inspect.signature(twin).parameters if self._functional else group
        for key, value in overrides.items():
            if key in self.defaults and key not in accepted and value != self.defaults[key]:
                raise ValueError(
                    f"param group {index} sets {key}={value!r}, but {twin.__name__} takes no "
                    f"{key!r}: it cannot differ from the default, {self.defaults[key]!r}"
                )
        self.param_groups.append({**group, "params": rrefs})
        passed = None if self._passed is None else self._passed | set(overrides)
        unset = [] if passed is None else [k for k in _KERNEL_FLAGS if k not in passed]
        self._owner_groups.append({**group, **dict.fromkeys(unset)})
        for rref in rrefs:
            self._owner_indices.setdefault(rref.owner().name, []).append(len(self.params_rref))
            self.params_rref.append(rref)
        if self._keys:  # after construction: send it now
            with self._lock:
                self._build([index])

    def _build(self, indices: Iterable[int]) -> None:
        """Send the param groups ``indices`` to their owners, creating a new owner's optimizer."""
        shares: dict[str, list[tuple[int, list[Any], dict[str, Any]]]] = {}
        for index in indices:
            for rref in self.param_groups[index]["params"]:
                owner = shares.setdefault(rref.owner().name, [])
                if not owner or owner[-1][0] != index:
                    owner.append((index, [], self._owner_groups[index]))
                owner[-1][1].append(rref)
        new = [o for o in shares if o not in self._keys]
        spec = lambda o: dataclasses.replace(self._spec, mode=self._modes[o])  # noqa: E731
        created = self._fan_out(_local.create, lambda o: (spec(o), shares[o]), new)
        self._rrefs.update({o: rref for o, (rref, _) in created.items()})
        self._keys.update({o: key for o, (_, key) in created.items()})
        added = [o for o in shares if o not in new]  # (one group: add_param_group's)
        self._fan_out(_local.call, lambda o: (self._keys[o], "add", *shares[o][0]), added)
        self._sent_hparams = self._hparams()

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
        check_context(context_id, "DistributedOptimizer")
        hparams = self._hparams()
        with self._lock:
            self._passes += 1
            apply = self._passes >= self.backward_passes_per_step
            coef = self._coef.pop(context_id, 1.0)
            if apply:
                self._passes = 0
                self._coef.clear()
            # Owners get a group's hyperparameters again only when they changed.
            sent: list[dict[str, Any]] = self._sent_hparams or []
            changed = {i: h for i, h in enumerate(hparams) if i >= len(sent) or h != sent[i]}
            self._sent_hparams = hparams
        try:
            self._call_owners("step", context_id, apply, coef, changed or None)
        except BaseException:
            self._sent_hparams = None  # some owner may have missed them: send on the next step
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
            passes, per_owner = self._passes, self._call_owners("state")
        state: dict[int, dict[str, Any]] = {}
        window: dict[int, Tensor] = {}
        for owner, indices in self._owner_indices.items():
            states, accum = per_owner[owner]
            for k, i in enumerate(indices):
                if states[k] is not None:
                    state[i] = states[k]
                if accum is not None and accum[k] is not None:
                    window[i] = accum[k]
        groups, start = [], 0
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
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        groups, given = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, Sequence) or not all(isinstance(g, Mapping) for g in groups):
            raise ValueError(
                f"state_dict['param_groups'] must be a list of dicts, got {groups!r:.99}"
            )
        if not isinstance(given, Mapping):
            raise ValueError(f"state_dict['state'] must be a dict, got {type(given).__name__}")
        sizes = [len(g["params"]) for g in self.param_groups]
        if (got := [len(g.get("params", ())) for g in groups]) != sizes:
            raise ValueError(
                f"state_dict must have {len(sizes)} param group(s) of {sizes} parameters, got {got}"
            )
        order = {pid: i for i, pid in enumerate(p for g in groups for p in g["params"])}
        for key, value in given.items():
            if key not in order or not isinstance(value, dict):
                raise ValueError(
                    f"state_dict['state'][{key!r}] must be a dict of state tensors, got "
                    f"{type(value).__name__}, for a parameter of its groups (0..{len(order) - 1})"
                )
        window = state_dict.get(_WINDOW)
        w = window if isinstance(window, Mapping) else {} if window is None else {"passes": None}
        passes, grads = w.get("passes", 0), w.get("gradients", {})
        if not (
            isinstance(passes, int)
            and isinstance(grads, Mapping)
            and (window is None or 0 < passes < self.backward_passes_per_step)
            and all(k in order and isinstance(g, Tensor) for k, g in grads.items())
        ):
            raise ValueError(
                f"state_dict['{_WINDOW}'] must be {{'passes': k, 'gradients': {{index: tensor}}}}"
                f" with 0 < k < backward_passes_per_step ({self.backward_passes_per_step}), got "
                f"{window!r:.200}"
            )
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
            self._passes, self._sent_hparams = passes, None  # owners get the loaded values
            self._coef.clear()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # The method form, ``opt.clip_grad_norm_(context_id, max_norm, ...)``: the function itself.
    clip_grad_norm_ = clip_grad_norm_

    def stage_gradients(
        self, context_id: int, inv_scale: float | None = None, norm_type: float | None = None
    ) -> list[tuple[bool, Tensor | None]]:
        """Have every owner scale the gradients the next ``step(context_id)`` applies and keep
        them for it (the building block of :class:`DistributedGradScaler` and clipping).

        Args:
            context_id: A distributed-autograd context id created in this process.
            inv_scale: Factor to unscale the gradients by, or ``None`` to leave them.
            norm_type: Order of the norm to report, or ``None`` for no norm.

        Returns:
            Per owner: ``(found inf/NaN, norm or None)``.
        """
        check_context(context_id, "DistributedOptimizer")
        apply = self.next_step_applies
        return list(self._call_owners("stage", context_id, apply, inv_scale, norm_type).values())

    def _hparams(self) -> list[dict[str, Any]]:
        """Each group's float hyperparameters, the ones owners follow step by step."""
        out: list[dict[str, Any]] = []
        for group in self.param_groups:
            out.append({})
            for key, value in group.items():
                if key in TUPLE_KEYS and isinstance(value, tuple):
                    out[-1][key] = tuple(float(v) for v in value)
                elif key not in ("params", "initial_lr") and (
                    is_number(value) or (isinstance(value, Tensor) and value.numel() == 1)
                ):
                    out[-1][key] = float(value)
        return out

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


def check_optimizer(optimizer: Any) -> None:
    """Raise ``TypeError`` unless ``optimizer`` is a :class:`DistributedOptimizer`."""
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(
            f"optimizer must be a metadist DistributedOptimizer, got {type(optimizer).__name__}"
        )


def is_number(value: Any, kind: type | tuple[type, ...] = (int, float)) -> bool:
    """Whether ``value`` is an instance of ``kind`` and not a bool (shared with grad_scaler)."""
    return isinstance(value, kind) and not isinstance(value, bool)


def _resolve_modes(mode: str | Mapping[str | int, str], workers: Sequence[str]) -> dict[str, str]:
    if isinstance(mode, str):
        if mode not in _local.MODES:
            raise ValueError(f"mode must be one of {_local.MODES} or a mapping, got {mode!r}")
        return dict.fromkeys(workers, mode)
    if not isinstance(mode, Mapping):
        raise ValueError(f"mode must be a str or a mapping worker -> mode, got {mode!r}")
    out = dict.fromkeys(workers, "auto")
    for worker, value in mode.items():
        if value not in _local.MODES:
            raise ValueError(f"mode[{worker!r}] must be one of {_local.MODES}, got {value!r}")
        try:
            out[get_worker_name(worker)] = value
        except (TypeError, ValueError) as exc:
            raise ValueError(f"mode names {worker!r}, which is not a worker: {exc}") from None
    return out


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
            probe = cls([torch.zeros(1, requires_grad=True)], *args, **kwargs)
            group = {k: v for k, v in probe.param_groups[0].items() if k != "params"}
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{cls.__name__} rejected args={args!r} kwargs={kwargs!r}: {exc}") from exc
    for flag in ("capturable", "differentiable"):
        if group.get(flag):
            raise ValueError(
                f"{flag}={group[flag]!r} is not supported by DistributedOptimizer "
                "(owners step outside autograd and graph capture)"
            )
    for flag in _KERNEL_FLAGS:
        if group.get(flag) is not None and not isinstance(group[flag], bool):
            raise TypeError(f"{flag} must be True, False or None (unset), got {group[flag]!r}")
    if group.get("foreach") and group.get("fused"):
        raise ValueError("fused=True and foreach=True cannot be used together; pick one")
    if functional:
        try:
            cls([], **group)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{cls.__name__} rejected {group!r}: {exc}") from exc
    return group


def _passed_names(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[str]:
    """Names of the constructor arguments the user passed (positionally or by keyword)."""
    try:
        bound = inspect.signature(cls).bind_partial(None, *args, **kwargs)
    except (TypeError, ValueError):
        return set(kwargs)
    # Keywords land under **kwargs' own name when the class takes **kwargs: count them too.
    return set(bound.arguments) | set(kwargs)
