"""The distributed optimizer: parameters stay on their owners, and so does the optimizer state."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from metadist.autograd import check_context
from metadist.optim import _local
from metadist.optim.functional import TUPLE_KEYS
from metadist.optim.registry import get_functional_optimizer
from metadist.optim.scripting import torchscript_status
from metadist.world import get_worker_name, get_worker_names, require_rpc, wait_all

__all__ = ["DistributedOptimizer", "clip_grad_norm_"]

_KERNEL_FLAGS = ("foreach", "fused")
# rpc.remote returns the C++ PyRRef; rpc.RRef is the typing-friendly Python subclass.
_RREF_TYPES = (rpc.RRef, rpc.PyRRef)  # type: ignore[attr-defined]
# The state_dict key of an open accumulation window (absent at a window's boundary).
_WINDOW = "accumulation"


class DistributedOptimizer(torch.optim.Optimizer):
    """Optimize parameters that live on several workers, each owner stepping its own share.

    A drop-in for ``torch.distributed.optim.DistributedOptimizer`` (same constructor, same
    ``step(context_id)``). The constructor creates one local optimizer on every owner of
    ``params_rref``; ``step(context_id)`` sends one request per owner, which updates the
    parameters that have a gradient in that distributed-autograd context (the others are left
    untouched; no stale ``.grad`` is re-applied). Concurrent ``step`` calls from several threads
    are serialized per owner.

    Each owner runs the functional twin of ``optimizer_class`` (see
    :func:`register_functional_optimizer`) eagerly with torch's fused or multi-tensor kernels
    (``"eager"``), compiled with TorchScript (``"scripted"``), or as ``"auto"`` picks (rules in
    the optimizer guide, ``docs/optim.md``); a class with no twin runs as itself. The object is
    a ``torch.optim.Optimizer`` with one param group, so ``torch.optim.lr_scheduler`` drives it:
    the group's float hyperparameters reach the owners with the next step after they change.
    Its ``state`` stays empty; ``state_dict()`` gathers the owners' state.

    Args:
        optimizer_class: A ``torch.optim.Optimizer`` subclass (e.g. ``torch.optim.Adam`` or
            :class:`metadist.optim.QHM`) or a registered functional class.
        params_rref: RRefs to the parameters (leaf tensors) on their owners; any mix of owners.
        *args: Positional hyperparameters for ``optimizer_class`` (after ``params``).
        mode: ``"auto"``, ``"eager"``, ``"scripted"``, or a mapping from worker name or rank to
            mode (unlisted owners use ``"auto"``).
        backward_passes_per_step: Accumulate the gradients of this many contexts (one per
            ``step`` call) and update on the last of them.
        average_accumulated: Divide the accumulated gradients by ``backward_passes_per_step``
            instead of summing them.
        timeout: Seconds each request may take (and each owner waits for its lock); ``None``
            uses the RPC world's timeout.
        **kwargs: Keyword hyperparameters for ``optimizer_class``.

    Raises:
        RuntimeError: If the RPC world is not running, or ``mode="scripted"`` is asked for
            where torch can no longer script.
        TypeError: If ``optimizer_class`` is neither a ``torch.optim.Optimizer`` subclass nor a
            registered functional class, ``params_rref`` holds a non-RRef,
            ``average_accumulated`` is not a bool, or ``foreach``/``fused`` is not a bool or
            ``None``.
        ValueError: On an empty or duplicated ``params_rref``, an unknown owner or ``mode``,
            ``backward_passes_per_step`` not an int ``>= 1``, ``foreach=True`` with
            ``fused=True``, a bad ``timeout``, or hyperparameters ``optimizer_class`` rejects.
            All checked before any request is sent.

    Example:
        A world of 1 (plain ``python``), where this process owns the parameter:

        >>> import torch
        >>> import torch.distributed.rpc as rpc
        >>> import metadist
        >>> from metadist.optim import DistributedOptimizer
        >>> @metadist.auto_init_rpc()
        ... def main():
        ...     w = rpc.RRef(torch.ones(3, requires_grad=True))
        ...     opt = DistributedOptimizer(torch.optim.SGD, [w], lr=0.5)
        ...     with metadist.autograd.context() as cid:
        ...         metadist.autograd.backward(cid, [w.to_here().sum()])
        ...         opt.step(cid)
        ...     return w.to_here(), opt.describe()
        >>> main()
        (tensor([0.5000, 0.5000, 0.5000], requires_grad=True), {'worker0': ('eager', 'fused', 1)})
    """

    def __init__(
        self,
        optimizer_class: type,
        params_rref: Sequence[rpc.RRef[Tensor]],
        *args: Any,
        mode: str | Mapping[str | int, str] = "auto",
        backward_passes_per_step: int = 1,
        average_accumulated: bool = True,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        require_rpc("DistributedOptimizer")
        if not isinstance(optimizer_class, type):
            raise TypeError(f"optimizer_class must be a class, got {optimizer_class!r}")
        functional_class = get_functional_optimizer(optimizer_class)
        if functional_class is None and not issubclass(optimizer_class, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass or a registered "
                f"functional optimizer class, got {optimizer_class!r}"
            )
        if isinstance(params_rref, _RREF_TYPES) or not isinstance(params_rref, Sequence):
            raise TypeError(
                f"params_rref must be a list of RRefs to parameters, got {type(params_rref)!r}"
            )
        if len(params_rref) == 0:
            raise ValueError("params_rref is empty; pass at least one parameter RRef")
        if not _is_number(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
            )
        if not isinstance(average_accumulated, bool):
            raise TypeError(
                f"average_accumulated must be a bool, got {average_accumulated!r} "
                f"of type {type(average_accumulated).__name__}"
            )
        if timeout is None:
            timeout = rpc.get_rpc_timeout()  # type: ignore[attr-defined]
        elif not (_is_number(timeout) and timeout > 0 and math.isfinite(timeout)):
            raise ValueError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        known, seen = get_worker_names(), set()
        self._owner_indices: dict[str, list[int]] = {}
        for i, rref in enumerate(params_rref):
            if not isinstance(rref, _RREF_TYPES):
                raise TypeError(f"params_rref[{i}] must be an RRef, got {type(rref).__name__}")
            if id(rref) in seen:
                raise ValueError(f"params_rref[{i}] is listed twice; pass each parameter once")
            seen.add(id(rref))
            owner = rref.owner().name
            if owner not in known:
                raise ValueError(
                    f"params_rref[{i}] is owned by {owner!r}, which is not a worker of this world "
                    f"(workers: {', '.join(known)})"
                )
            self._owner_indices.setdefault(owner, []).append(i)
        modes = _resolve_modes(mode, set(self._owner_indices))
        if "scripted" in modes.values() and not (status := torchscript_status())[0]:
            raise RuntimeError(
                f"mode='scripted' needs TorchScript: {status[1]}. Use mode='eager' (or "
                "'auto'), which steps the same functional optimizer without compiling it"
            )
        group = _param_group(optimizer_class, functional_class is optimizer_class, args, kwargs)

        self.optimizer_class = optimizer_class
        self.backward_passes_per_step = backward_passes_per_step
        self.average_accumulated = average_accumulated
        self.timeout = float(timeout)
        self.params_rref = list(params_rref)
        # torch.optim.Optimizer surface (deliberately not calling its __init__: it wants local
        # tensors). One group; "params" holds the RRefs.
        self.defaults = dict(group)
        self.param_groups: list[dict[str, Any]] = [{**group, "params": self.params_rref}]
        self.state: defaultdict[Any, Any] = defaultdict(dict)
        self._passes = 0
        self._coef: dict[int, float] = {}
        self._lock = _local.TimedLock(self.timeout, "the optimizer lock")
        # Owners are built with these hyperparameters; a step sends them again only on change.
        self._sent_hparams: dict[str, Any] | None = self._hparams()
        self._me = get_worker_name()

        ctor_kwargs = dict(group)
        if functional_class is not None:
            # Owners auto-pick only kernel flags that are unset (None). A flag the user did not
            # pass is unset whatever the class defaults it to.
            passed = _passed_names(optimizer_class, args, kwargs)
            for flag in _KERNEL_FLAGS:
                if flag in ctor_kwargs and flag not in passed:
                    ctor_kwargs[flag] = None
        spec = _local.Spec(
            optimizer_class,
            functional_class,
            ctor_kwargs,
            "auto",
            backward_passes_per_step,
            average_accumulated,
            self.timeout,
        )
        created = self._fan_out(
            _local.create,
            lambda o: (
                dataclasses.replace(spec, mode=modes[o]),
                [self.params_rref[i] for i in self._owner_indices[o]],
            ),
        )
        # The RRefs keep the owners' optimizers alive; requests address them by key.
        self._rrefs = {o: rref for o, (rref, _) in created.items()}
        self._keys: dict[str, int] = {o: key for o, (_, key) in created.items()}

    # -- torch.optim.Optimizer surface -----------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DistributedOptimizer cannot be pickled; use state_dict() instead")

    def __repr__(self) -> str:
        hyper = ", ".join(f"{k}={v!r}" for k, v in self.param_groups[0].items() if k != "params")
        return (
            f"DistributedOptimizer({self.optimizer_class.__name__}, "
            f"{len(self.params_rref)} params on {len(self._owner_indices)} owners, {hyper})"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Do nothing: distributed-autograd gradients live in their context, not in ``.grad``.

        Args:
            set_to_none: Ignored; kept for ``torch.optim.Optimizer`` compatibility.
        """

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: a DistributedOptimizer has exactly one param group.

        Args:
            param_group: Ignored.

        Raises:
            NotImplementedError: Always.
        """
        raise NotImplementedError(
            "DistributedOptimizer has one param group; create a second DistributedOptimizer "
            "for parameters that need different hyperparameters"
        )

    @property
    def next_step_applies(self) -> bool:
        """Whether the next ``step`` updates the parameters (last pass of an accumulation window).

        Example:
            ``if opt.next_step_applies: clip_grad_norm_(opt, cid, max_norm=1.0)``
        """
        return self._passes + 1 >= self.backward_passes_per_step

    def describe(self) -> dict[str, tuple[str, str, int]]:
        """Return, per owner, the mode and kernel chosen there and how many parameters it holds.

        Returns:
            ``{worker_name: (mode, kernel, num_params)}``, mode ``"eager"``/``"scripted"``/
            ``"torch"`` and kernel ``"fused"``/``"foreach"``/``"single-tensor"``/``"torch.optim"``.
        """
        return self._call_owners("describe")

    def step(self, context_id: int) -> None:  # type: ignore[override]
        """Apply the gradients of ``context_id`` on every owner (one request per owner).

        With ``backward_passes_per_step = N > 1`` the first ``N - 1`` calls only accumulate (on
        the owners) and the ``N``-th updates the parameters.

        Args:
            context_id: A distributed-autograd context id created in this process.

        Raises:
            ValueError: If ``context_id`` is not a live context of this process (checked before
                any request).
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
            changed = None if hparams == self._sent_hparams else hparams
            self._sent_hparams = hparams
        try:
            self._call_owners("step", context_id, apply, coef, changed)
        except BaseException:
            self._sent_hparams = None  # some owner may have missed them: send on the next step
            raise

    def skip(self, context_id: int) -> None:
        """Drop the gradients of ``context_id`` and of the current accumulation window everywhere
        (what :class:`DistributedGradScaler` does when an owner found an inf/NaN).

        Args:
            context_id: A distributed-autograd context id created in this process.

        Raises:
            ValueError: If ``context_id`` is not a live context of this process.
        """
        check_context(context_id, "DistributedOptimizer")
        with self._lock:
            self._passes = 0
            self._coef.clear()
        self._call_owners("skip")

    def state_dict(self) -> dict[str, Any]:
        """Gather the owners' state into one ``torch.optim``-format state dict on the caller.

        Parameter ``i`` of the dict is ``params_rref[i]``. Taken mid-window, the dict also holds
        the accumulation window, so that :meth:`load_state_dict` resumes it.

        Returns:
            ``{"state": {index: {name: tensor}}, "param_groups": [{..., "params": [0, ...]}]}``
            (plus ``"accumulation": {"passes": k, "gradients": {index: tensor}}`` mid-window).
        """
        with self._lock:
            passes = self._passes
            per_owner = self._call_owners("state")
        state: dict[int, dict[str, Any]] = {}
        window: dict[int, Tensor] = {}
        for owner, indices in self._owner_indices.items():
            states, accum = per_owner[owner]
            for k, i in enumerate(indices):
                if states[k] is not None:
                    state[i] = states[k]
                if accum is not None and accum[k] is not None:
                    window[i] = accum[k]
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.params_rref)))
        out: dict[str, Any] = {"state": dict(sorted(state.items())), "param_groups": [group]}
        if passes:
            out[_WINDOW] = {"passes": passes, "gradients": dict(sorted(window.items()))}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Send the state of a :meth:`state_dict` result back to the owners.

        Also restores the param group's hyperparameters and the accumulation window: the one
        saved mid-window, else a fresh one (gradients accumulated before the load are dropped).

        Args:
            state_dict: A dict from :meth:`state_dict` (or a ``torch.optim`` state dict of the
                same algorithm over the same parameters, in ``params_rref`` order).

        Raises:
            ValueError: If the dict is not in ``torch.optim`` format, does not have one param
                group over exactly ``len(params_rref)`` parameters, a state index is out of
                range, or its accumulation window does not fit ``backward_passes_per_step``.
                Checked before any request.
        """
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError(
                "state_dict must be a dict with 'state' and 'param_groups', got "
                f"{type(state_dict).__name__} with keys {list(state_dict)[:5]!r}"
                if isinstance(state_dict, Mapping)
                else f"state_dict must be a dict, got {type(state_dict).__name__}"
            )
        groups, n = state_dict["param_groups"], len(self.params_rref)
        if not isinstance(groups, Sequence) or not all(isinstance(g, Mapping) for g in groups):
            raise ValueError(
                f"state_dict['param_groups'] must be a list of dicts, got {groups!r:.200}"
            )
        if not isinstance(state_dict["state"], Mapping):
            raise ValueError(
                f"state_dict['state'] must be a dict {{index: {{name: value}}}}, got "
                f"{type(state_dict['state']).__name__}"
            )
        if len(groups) != 1 or len(groups[0].get("params", ())) != n:
            raise ValueError(
                f"state_dict must have 1 param group over {n} parameters, got "
                f"{len(groups)} group(s) with {[len(g.get('params', ())) for g in groups]} params"
            )
        order = {pid: i for i, pid in enumerate(groups[0]["params"])}
        states: dict[int, dict[str, Any]] = {}
        for key, value in state_dict["state"].items():
            if key not in order or not isinstance(value, dict):
                raise ValueError(
                    f"state_dict['state'][{key!r}] must be a dict of state tensors, got "
                    f"{type(value).__name__}, for a parameter of its param group (0..{n - 1})"
                )
            states[order[key]] = value
        window = state_dict.get(_WINDOW)
        passes = window.get("passes") if isinstance(window, Mapping) else None
        grads = window.get("gradients") if isinstance(window, Mapping) else None
        if window is not None and (
            not isinstance(passes, int)
            or not 0 < passes < self.backward_passes_per_step
            or not isinstance(grads, Mapping)
            or not all(k in order and isinstance(g, Tensor) for k, g in grads.items())
        ):
            raise ValueError(
                f"state_dict['{_WINDOW}'] must be {{'passes': k, 'gradients': {{index: tensor}}}}"
                f" with 0 < k < backward_passes_per_step ({self.backward_passes_per_step}), got "
                f"{window!r:.200}"
            )
        accum = {order[k]: g for k, g in grads.items()} if grads is not None else None
        chunks = {
            owner: (
                [states.get(i) for i in indices],
                None if accum is None else [accum.get(i) for i in indices],
            )
            for owner, indices in self._owner_indices.items()
        }
        with self._lock:
            self._call_owners("load_state", per_owner=chunks)
            self.param_groups[0].update({k: v for k, v in groups[0].items() if k != "params"})
            self._passes = passes or 0
            self._coef.clear()
            self._sent_hparams = None  # the owners get the loaded hyperparameters on next step

    def clip_grad_norm_(
        self,
        context_id: int,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> Tensor:
        """:func:`clip_grad_norm_` of this optimizer's gradients of ``context_id``.

        Args:
            context_id: A distributed-autograd context id created in this process.
            max_norm: Largest allowed total norm.
            norm_type: Order of the norm (``float("inf")`` for the max norm).
            error_if_nonfinite: Raise if the total norm is inf or NaN.

        Returns:
            The total norm before clipping (0-dim float tensor).
        """
        return clip_grad_norm_(self, context_id, max_norm, norm_type, error_if_nonfinite)

    def stage_gradients(
        self, context_id: int, inv_scale: float | None = None, norm_type: float | None = None
    ) -> list[tuple[bool, Tensor | None]]:
        """Prepare, on every owner, the gradients the next ``step(context_id)`` applies.

        The building block of :class:`DistributedGradScaler` and :func:`clip_grad_norm_` (one
        request per owner): each owner takes the gradients that step will use, multiplies them by
        ``inv_scale``, reports inf/NaN and their norm, and keeps them for the step.

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

    # -- internals ---------------------------------------------------------------------------

    def _hparams(self) -> dict[str, Any]:
        """The param group's float hyperparameters, the ones owners follow step by step."""
        out: dict[str, Any] = {}
        for key, value in self.param_groups[0].items():
            if key in TUPLE_KEYS and isinstance(value, tuple):
                out[key] = tuple(float(v) for v in value)
            elif key not in ("params", "initial_lr") and (
                _is_number(value) or (isinstance(value, Tensor) and value.numel() == 1)
            ):
                out[key] = float(value)
        return out

    def _fan_out(self, fn: Callable[..., Any], args: Callable[[str], tuple[Any, ...]]) -> Any:
        """``fn(*args(owner))`` for every owner: the others by RPC, concurrently with this
        process's own share, run inline. Raises the first error once every owner has replied."""
        futures = {
            owner: rpc.rpc_async(owner, fn, args=args(owner), timeout=self.timeout)
            for owner in self._owner_indices
            if owner != self._me
        }
        results: dict[str, Any] = {}
        error: BaseException | None = None
        if self._me in self._owner_indices:
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
            _local.call, lambda o: (self._keys[o], method, *(per_owner[o] if per_owner else args))
        )


def clip_grad_norm_(
    optimizer: DistributedOptimizer,
    context_id: int,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> Tensor:
    """Clip the gradients the next ``optimizer.step(context_id)`` applies, by their global norm.

    The norm is taken over every owner's gradients (one request per owner), as
    ``torch.nn.utils.clip_grad_norm_`` would over the same gradients in one process:
    ``coef = min(1, max_norm / (total_norm + 1e-6))``, applied on the owners when ``step`` runs
    (the context's gradient tensors are not modified). With accumulation, call it when
    ``optimizer.next_step_applies``; with a :class:`DistributedGradScaler`, after
    ``scaler.unscale_``.

    Args:
        optimizer: The :class:`DistributedOptimizer` whose parameters' gradients to clip.
        context_id: A distributed-autograd context id created in this process.
        max_norm: Largest allowed total norm (``> 0``).
        norm_type: Order of the norm, ``> 0`` or ``float("inf")``.
        error_if_nonfinite: Raise if the total norm is inf or NaN.

    Returns:
        The total norm of the gradients before clipping (0-dim float tensor).

    Raises:
        TypeError: If ``optimizer`` is not a :class:`DistributedOptimizer`.
        ValueError: On a non-positive ``max_norm`` or ``norm_type`` or an unknown context.
        RuntimeError: If ``error_if_nonfinite`` and the total norm is not finite.

    Example:
        >>> import torch
        >>> import torch.distributed.rpc as rpc
        >>> import metadist
        >>> from metadist.optim import DistributedOptimizer, clip_grad_norm_
        >>> @metadist.auto_init_rpc()
        ... def main():
        ...     w = rpc.RRef(torch.ones(3, requires_grad=True))
        ...     opt = DistributedOptimizer(torch.optim.SGD, [w], lr=1.0)
        ...     with metadist.autograd.context() as cid:
        ...         metadist.autograd.backward(cid, [w.to_here().sum()])
        ...         total = clip_grad_norm_(opt, cid, max_norm=1.0)  # norm before clipping
        ...         opt.step(cid)
        ...     return total, w.to_here().detach()
        >>> main()
        (tensor(1.7321), tensor([0.4227, 0.4227, 0.4227]))
    """
    check_optimizer(optimizer)
    if not _is_number(max_norm) or not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    if not _is_number(norm_type) or not norm_type > 0:
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
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    optimizer._coef[context_id] = previous * float(coef)
    return total


def check_optimizer(optimizer: Any) -> None:
    """Raise ``TypeError`` unless ``optimizer`` is a :class:`DistributedOptimizer`."""
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(
            f"optimizer must be a metadist DistributedOptimizer, got {type(optimizer).__name__}"
        )


def _is_number(value: Any, kind: type | tuple[type, ...] = (int, float)) -> bool:
    # A bool is an int to Python, never a count or a number of seconds here.
    return isinstance(value, kind) and not isinstance(value, bool)


def _resolve_modes(mode: str | Mapping[str | int, str], owners: set[str]) -> dict[str, str]:
    if isinstance(mode, str):
        if mode not in _local.MODES:
            raise ValueError(f"mode must be one of {_local.MODES} or a mapping, got {mode!r}")
        return dict.fromkeys(owners, mode)
    if not isinstance(mode, Mapping):
        raise ValueError(f"mode must be a str or a mapping worker -> mode, got {mode!r}")
    out = dict.fromkeys(owners, "auto")
    for worker, value in mode.items():
        if value not in _local.MODES:
            raise ValueError(f"mode[{worker!r}] must be one of {_local.MODES}, got {value!r}")
        try:
            out[get_worker_name(worker)] = value
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"mode has an entry for {worker!r}, which is not a worker: {exc}"
            ) from None
    return out


def _param_group(
    cls: type, functional: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Check the hyperparameters by building ``cls`` (over a probe tensor, or over no
    parameters for a functional class); return its param group without ``params``."""

    def build(params: list[Tensor], *a: Any, **kw: Any) -> Any:
        try:
            return cls(params, *a, **kw)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(
                f"{cls.__name__} rejected the hyperparameters args={args!r} kwargs={kwargs!r}: "
                f"{exc}"
            ) from exc

    if functional:
        signature = inspect.signature(cls)
        try:
            bound = signature.bind([], *args, **kwargs)
        except TypeError as exc:
            raise ValueError(f"{cls.__name__}{signature}: {exc}") from exc
        bound.apply_defaults()
        group = {k: v for k, v in bound.arguments.items() if k != "params"}
    else:
        probe = build([torch.zeros(1, requires_grad=True)], *args, **kwargs)
        groups = getattr(probe, "param_groups", None)
        if not groups:
            raise ValueError(f"{cls.__name__} has no param_groups; is it an optimizer?")
        group = {k: v for k, v in groups[0].items() if k != "params"}
    for flag in ("capturable", "differentiable"):
        if group.get(flag):
            raise ValueError(
                f"{flag}={group[flag]!r} is not supported by DistributedOptimizer "
                "(owners step outside autograd and graph capture)"
            )
    for flag in _KERNEL_FLAGS:
        if group.get(flag) is not None and not isinstance(group[flag], bool):
            raise TypeError(
                f"{flag} must be True, False or None (unset), got {group[flag]!r} "
                f"of type {type(group[flag]).__name__}"
            )
    if group.get("foreach") and group.get("fused"):
        raise ValueError("fused=True and foreach=True cannot be used together; pick one")
    if functional:
        build([], **group)
    return group


def _passed_names(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[str]:
    """Names of the constructor arguments the user passed (positionally or by keyword)."""
    try:
        bound = inspect.signature(cls).bind_partial(None, *args, **kwargs)
    except (TypeError, ValueError):
        return set(kwargs)
    # Keywords land under **kwargs' own name when the class takes **kwargs: count them too.
    return set(bound.arguments) | set(kwargs)
