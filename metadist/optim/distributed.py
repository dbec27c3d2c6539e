"""The distributed optimizer: parameters stay on their owners, and so does the optimizer state.

:class:`DistributedOptimizer` is a drop-in for ``torch.distributed.optim.DistributedOptimizer``
(same constructor, same ``step(context_id)``) that also has ``param_groups`` for learning-rate
schedulers, ``state_dict``/``load_state_dict``, gradient accumulation, a shard-aware gradient
scaler (:class:`metadist.optim.DistributedGradScaler`) and global-norm clipping
(:func:`clip_grad_norm_`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.futures import Future

from metadist.autograd import check_context
from metadist.optim import _local
from metadist.optim.registry import get_functional_optimizer
from metadist.optim.scripting import torchscript_status
from metadist.world import get_worker_name, get_worker_names, require_rpc, wait_all

__all__ = ["DistributedOptimizer", "clip_grad_norm_"]

_UNSUPPORTED_FLAGS = ("capturable", "differentiable")
_KERNEL_FLAGS = ("foreach", "fused")
# rpc.remote returns the C++ PyRRef; rpc.RRef is the typing-friendly Python subclass.
_RREF_TYPES = (rpc.RRef, rpc.PyRRef)  # type: ignore[attr-defined]
# The state_dict key of an open accumulation window (absent at a window's boundary).
_WINDOW = "accumulation"


class DistributedOptimizer(torch.optim.Optimizer):
    """Optimize parameters that live on several workers, each owner stepping its own share.

    The constructor groups ``params_rref`` by owner and creates one local optimizer on every owner
    (one request each). ``step(context_id)`` sends one request per owner; each owner reads its
    gradients of that distributed-autograd context with
    ``torch.distributed.autograd.get_gradients`` and updates its parameters in place. A parameter
    with no gradient in the context is left untouched (no stale ``.grad`` is ever re-applied), and
    concurrent ``step`` calls from several trainer threads are serialized per owner.

    Each owner runs the functional twin of ``optimizer_class`` (see
    :func:`register_functional_optimizer`) in one of these modes:

    * ``"eager"``: plain Python calling torch's fastest CPU kernels: ``fused`` where torch has one
      (SGD, Adam, AdamW, Adagrad on floating-point CPU parameters), otherwise ``foreach``
      (multi-tensor) when the owner holds many small parameters (mean size <= 32,768 elements),
      otherwise the per-tensor loop. Only flags left unset (``None``) are picked:
      ``fused=False`` rules the fused kernel out, ``foreach=False`` the multi-tensor one, and
      ``True`` forces a kernel.
    * ``"scripted"``: the functional optimizer compiled with ``torch.jit.script`` and stepped
      without the GIL (the per-tensor loop). Raises where torch can no longer script.
    * ``"auto"`` (default): ``"eager"`` for functional classes that accept ``foreach``/``fused``
      (all of metadist's); for user classes that do not, ``"scripted"`` where TorchScript
      neither warns nor fails, else ``"eager"`` (saying so once in the ``metadist`` log).

    Pass ``mode`` as one string for every owner or as a mapping from worker name or rank to
    mode (unlisted owners use ``"auto"``). An ``optimizer_class`` with no functional twin runs as
    itself on each owner (``.grad`` is set from the context for exactly the parameters that have
    a gradient, and cleared afterwards).

    The object is a ``torch.optim.Optimizer`` with one param group, so
    ``torch.optim.lr_scheduler`` schedulers drive it: the group's float hyperparameters (``lr``,
    ``momentum``, ``betas``, ``weight_decay``, ...) reach every owner with the next step after
    they change. Its ``state`` attribute stays empty: the state lives on the owners;
    ``state_dict()`` gathers it in ``torch.optim`` format.

    Args:
        optimizer_class: A ``torch.optim.Optimizer`` subclass (e.g. ``torch.optim.Adam`` or
            :class:`metadist.optim.QHM`) or a registered functional class.
        params_rref: RRefs to the parameters (leaf tensors) on their owners; any mix of owners.
        *args: Positional hyperparameters for ``optimizer_class`` (after ``params``).
        mode: ``"auto"``, ``"eager"``, ``"scripted"``, or a mapping worker -> mode.
        backward_passes_per_step: Accumulate the gradients of this many contexts (one per
            ``step`` call) and update on the last of them.
        average_accumulated: Divide the accumulated gradients by ``backward_passes_per_step``
            (the "larger batch" rule) instead of summing them.
        timeout: Seconds each request may take (and each owner waits for its lock); ``None``
            uses the RPC world's timeout (``torch.distributed.rpc.get_rpc_timeout()``).
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
        A world of 1 (plain ``python``), where this process owns the parameter; with more
        workers, pass RRefs owned by them (``rpc.remote(name, make_param)``):

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
        if (
            not isinstance(backward_passes_per_step, int)
            or isinstance(backward_passes_per_step, bool)
            or backward_passes_per_step < 1
        ):
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
        elif not (
            isinstance(timeout, int | float)
            and not isinstance(timeout, bool)
            and timeout > 0
            and math.isfinite(timeout)
        ):
            raise ValueError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        known = get_worker_names()
        seen: set[int] = set()
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
        modes = _resolve_modes(mode, {r.owner().name for r in params_rref})
        if "scripted" in modes.values():
            works, problem = torchscript_status()
            if not works:
                raise RuntimeError(
                    f"mode='scripted' needs TorchScript: {problem}. Use mode='eager' (or "
                    "'auto'), which steps the same functional optimizer without compiling it"
                )
        if functional_class is optimizer_class:
            group = _functional_group(optimizer_class, args, kwargs)
        else:
            group = _torch_group(optimizer_class, args, kwargs)
        for flag in _UNSUPPORTED_FLAGS:
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
        self._caller_lock = threading.Lock()
        # Owners are built with these hyperparameters; a step sends them again only on change.
        self._sent_hparams: dict[str, Any] | None = self._hparams()
        self._me = get_worker_name()
        self._owner_indices: dict[str, list[int]] = {}
        for i, rref in enumerate(self.params_rref):
            self._owner_indices.setdefault(rref.owner().name, []).append(i)

        ctor_kwargs = dict(group)
        if functional_class is not None:
            # Owners auto-pick only kernel flags that are unset (None). A flag the user did not
            # pass is unset whatever the class defaults it to, so an explicit False stays
            # distinguishable from "not given".
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

        def rrefs(owner: str) -> list[rpc.RRef[Tensor]]:
            return [self.params_rref[i] for i in self._owner_indices[owner]]

        futures = {
            owner: rpc.rpc_async(
                owner,
                _local.create,
                args=(dataclasses.replace(spec, mode=modes[owner]), rrefs(owner)),
                timeout=self.timeout,
            )
            for owner in self._owner_indices
            if owner != self._me
        }
        self._local: _local.LocalOptimizer | None = None
        error: BaseException | None = None
        if self._me in self._owner_indices:
            try:
                self._local = _local.build(
                    dataclasses.replace(spec, mode=modes[self._me]), rrefs(self._me)
                )
            except BaseException as exc:  # still collect the owners' replies
                error = exc
        created = _wait_all(futures, error)
        # The RRefs keep the owners' optimizers alive; requests address them by key.
        self._remote_rrefs = {o: rref for o, (rref, _) in created.items()}
        self._remote: dict[str, int] = {o: key for o, (_, key) in created.items()}

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

        Example:
            ``opt.zero_grad()`` may stay in a training loop written for ``torch.optim``.
        """

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: a DistributedOptimizer has exactly one param group.

        Args:
            param_group: Ignored.

        Raises:
            NotImplementedError: Always.

        Example:
            Create a second ``DistributedOptimizer`` for parameters that need other
            hyperparameters.
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

        Example:
            ``opt.describe()`` gives e.g. ``{'worker1': ('eager', 'fused', 2)}``.
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

        Example:
            ``dist_autograd.backward(cid, [loss])`` then ``opt.step(cid)``, inside the context.
        """
        check_context(context_id, "DistributedOptimizer")
        hparams = self._hparams()
        with self._caller():
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
        """Drop the gradients of ``context_id`` and of the current accumulation window everywhere.

        Used by :class:`DistributedGradScaler` when any owner found an inf/NaN.

        Args:
            context_id: A distributed-autograd context id created in this process.

        Raises:
            ValueError: If ``context_id`` is not a live context of this process.

        Example:
            ``opt.skip(cid)``: no owner updates, and the window starts again.
        """
        check_context(context_id, "DistributedOptimizer")
        with self._caller():
            self._passes = 0
            self._coef.clear()
        self._call_owners("skip")

    def state_dict(self) -> dict[str, Any]:
        """Gather the owners' state into one ``torch.optim``-format state dict on the caller.

        Parameter ``i`` of the dict is ``params_rref[i]``. Taken in the middle of an accumulation
        window, the dict also holds the window (``"accumulation"``: the passes so far and the
        gradients accumulated on the owners), so that :meth:`load_state_dict` resumes it.

        Returns:
            ``{"state": {index: {name: tensor}}, "param_groups": [{..., "params": [0, ...]}]}``
            (plus ``"accumulation": {"passes": k, "gradients": {index: tensor}}`` mid-window).

        Example:
            ``torch.save(opt.state_dict(), "opt.pt")``
        """
        with self._caller():
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

        Also restores the param group's hyperparameters (``lr``, ``initial_lr``, ...) and the
        accumulation window: the one saved mid-window, else a fresh one (gradients accumulated
        before the load are dropped).

        Args:
            state_dict: A dict from :meth:`state_dict` (or a ``torch.optim`` state dict of the
                same algorithm over the same parameters, in ``params_rref`` order).

        Raises:
            ValueError: If the dict is not in ``torch.optim`` format (``"state"`` a dict of
                dicts, ``"param_groups"`` a list of dicts), does not have one param group over
                exactly ``len(params_rref)`` parameters, a state index is out of range, or its
                accumulation window does not fit ``backward_passes_per_step``. Checked before
                any request.

        Example:
            ``opt.load_state_dict(torch.load("opt.pt"))``
        """
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError(
                "state_dict must be a dict with 'state' and 'param_groups', got "
                f"{type(state_dict).__name__} with keys {list(state_dict)[:5]!r}"
                if isinstance(state_dict, Mapping)
                else f"state_dict must be a dict, got {type(state_dict).__name__}"
            )
        groups = state_dict["param_groups"]
        n = len(self.params_rref)
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
            if key not in order:
                raise ValueError(
                    f"state_dict['state'] has an entry for parameter {key!r}, which is not in "
                    f"its param group (0..{n - 1})"
                )
            if not isinstance(value, dict):
                raise ValueError(
                    f"state_dict['state'][{key!r}] must be a dict of state tensors, got "
                    f"{type(value).__name__}"
                )
            states[order[key]] = value
        passes, window = self._check_window(state_dict.get(_WINDOW), order)
        chunks = {
            owner: (
                [states.get(i) for i in indices],
                None if window is None else [window.get(i) for i in indices],
            )
            for owner, indices in self._owner_indices.items()
        }
        with self._caller():
            self._call_owners("load_state", per_owner=chunks)
            self.param_groups[0].update({k: v for k, v in groups[0].items() if k != "params"})
            self._passes = passes
            self._coef.clear()
            self._sent_hparams = None  # the owners get the loaded hyperparameters on next step

    def clip_grad_norm_(
        self,
        context_id: int,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> Tensor:
        """Clip the gradients of ``context_id`` by their global norm over all owners.

        Same as :func:`clip_grad_norm_` (which see).

        Args:
            context_id: A distributed-autograd context id created in this process.
            max_norm: Largest allowed total norm.
            norm_type: Order of the norm (``float("inf")`` for the max norm).
            error_if_nonfinite: Raise if the total norm is inf or NaN.

        Returns:
            The total norm before clipping (0-dim float tensor).

        Example:
            ``total = opt.clip_grad_norm_(cid, max_norm=1.0)`` before ``opt.step(cid)``.
        """
        return clip_grad_norm_(self, context_id, max_norm, norm_type, error_if_nonfinite)

    # -- internals ---------------------------------------------------------------------------

    def _caller(self) -> _Held:
        return _Held(self._caller_lock, self.timeout)

    def _hparams(self) -> dict[str, Any]:
        """The param group's float hyperparameters, the ones owners follow step by step."""
        out: dict[str, Any] = {}
        for key, value in self.param_groups[0].items():
            if key in ("params", "initial_lr") or isinstance(value, bool) or value is None:
                continue
            if isinstance(value, int | float):
                out[key] = float(value)
            elif isinstance(value, Tensor) and value.numel() == 1:
                out[key] = float(value.item())
            elif isinstance(value, tuple) and key in _local.TUPLE_KEYS:
                out[key] = tuple(float(v) for v in value)
        return out

    def _check_window(
        self, window: Any, order: dict[Any, int]
    ) -> tuple[int, dict[int, Tensor] | None]:
        if window is None:
            return 0, None
        passes = window.get("passes") if isinstance(window, Mapping) else None
        grads = window.get("gradients") if isinstance(window, Mapping) else None
        if (
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
        return passes, {order[k]: g for k, g in grads.items()}

    def stage_gradients(
        self, context_id: int, inv_scale: float | None = None, norm_type: float | None = None
    ) -> list[tuple[bool, Tensor | None]]:
        """Prepare, on every owner, the gradients the next ``step(context_id)`` applies.

        The building block of :class:`DistributedGradScaler` and :func:`clip_grad_norm_` (one
        request per owner): each owner takes the gradients that step will use (with the
        accumulation window when it applies), multiplies them by ``inv_scale`` and reports
        inf/NaN, measures their norm, and keeps them for the step.

        Args:
            context_id: A distributed-autograd context id created in this process.
            inv_scale: Factor to unscale the gradients by, or ``None`` to leave them.
            norm_type: Order of the norm to report, or ``None`` for no norm.

        Returns:
            Per owner: ``(found inf/NaN, norm or None)``.

        Example:
            ``any(inf for inf, _ in opt.stage_gradients(cid, inv_scale=1 / 1024))``
        """
        check_context(context_id, "DistributedOptimizer")
        apply = self.next_step_applies
        return list(self._call_owners("stage", context_id, apply, inv_scale, norm_type).values())

    def _call_owners(
        self, method: str, *args: Any, per_owner: Mapping[str, tuple[Any, ...]] | None = None
    ) -> dict[str, Any]:
        """Run ``method`` on every owner's local optimizer, the remote ones concurrently with
        this process's own; raise the first error once every owner has replied."""
        futures = {
            owner: rpc.rpc_async(
                owner,
                _local.call,
                args=(key, method, *(per_owner[owner] if per_owner else args)),
                timeout=self.timeout,
            )
            for owner, key in self._remote.items()
        }
        results: dict[str, Any] = {}
        error: BaseException | None = None
        if self._local is not None:
            try:
                own_args = per_owner[self._me] if per_owner else args
                results[self._me] = getattr(self._local, method)(*own_args)
            except BaseException as exc:  # still collect the owners' replies
                error = exc
        results.update(_wait_all(futures, error))
        return results


class _Held:
    """``with`` a lock taken with a timeout (a plain class: cheaper than a generator)."""

    __slots__ = ("lock", "timeout")

    def __init__(self, lock: threading.Lock, timeout: float) -> None:
        self.lock, self.timeout = lock, timeout

    def __enter__(self) -> None:
        # A world without an RPC timeout (<= 0) waits as long as its calls do.
        if not self.lock.acquire(timeout=self.timeout if self.timeout > 0 else -1):
            raise TimeoutError(f"timed out after {self.timeout}s waiting for the optimizer lock")

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def clip_grad_norm_(
    optimizer: DistributedOptimizer,
    context_id: int,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> Tensor:
    """Clip the gradients the next ``optimizer.step(context_id)`` applies, by their global norm.

    The norm is taken over the gradients of every owner (one request per owner), exactly as
    ``torch.nn.utils.clip_grad_norm_`` would over the same gradients in one process:
    ``coef = min(1, max_norm / (total_norm + 1e-6))``. The gradients are scaled on the owners
    when ``step`` runs (the context's own gradient tensors are not modified). With gradient
    accumulation, call it when ``optimizer.next_step_applies`` is true, so that the accumulated
    gradients are clipped; with a :class:`DistributedGradScaler`, call ``scaler.unscale_`` first.

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
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(
            f"optimizer must be a metadist DistributedOptimizer, got {type(optimizer).__name__}"
        )
    if not isinstance(max_norm, int | float) or not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    if not isinstance(norm_type, int | float) or not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 or float('inf'), got {norm_type!r}")
    results = optimizer.stage_gradients(context_id, norm_type=float(norm_type))
    norms = [n for _, n in results if n is not None]
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), float(norm_type))
    previous = optimizer._coef.get(context_id, 1.0)
    total = total * previous
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients of context {context_id} is "
            f"{float(total)}; set error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    optimizer._coef[context_id] = previous * float(coef)
    return total


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
            name = get_worker_name(worker)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"mode has an entry for {worker!r}, which is not a worker: {exc}"
            ) from None
        out[name] = value
    return out


def _torch_group(
    optimizer_class: type, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Validate hyperparameters by building the optimizer on a dummy tensor; return its group."""
    probe = torch.zeros(1, requires_grad=True)
    try:
        optim = optimizer_class([probe], *args, **kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(
            f"{optimizer_class.__name__} rejected the hyperparameters args={args!r} "
            f"kwargs={kwargs!r}: {exc}"
        ) from exc
    groups = getattr(optim, "param_groups", None)
    if not groups:
        raise ValueError(f"{optimizer_class.__name__} has no param_groups; is it an optimizer?")
    return {k: v for k, v in groups[0].items() if k != "params"}


def _functional_group(
    functional_class: type, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Bind hyperparameters to a functional class's signature; return them as a group dict."""
    signature = inspect.signature(functional_class.__init__)  # type: ignore[misc]
    try:
        bound = signature.bind(None, [], *args, **kwargs)
    except TypeError as exc:
        raise ValueError(f"{functional_class.__name__}{signature}: {exc}") from exc
    bound.apply_defaults()
    try:
        functional_class([], *args, **kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(
            f"{functional_class.__name__} rejected the hyperparameters: {exc}"
        ) from exc
    return {k: v for k, v in bound.arguments.items() if k not in ("self", "params")}


def _passed_names(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[str]:
    """Names of the constructor arguments the user passed (positionally or by keyword)."""
    try:
        bound = inspect.signature(cls.__init__).bind_partial(None, None, *args, **kwargs)  # type: ignore[misc]
    except (TypeError, ValueError):
        return set(kwargs)
    # Keywords land under **kwargs' own name when the class takes **kwargs: count them too.
    return set(bound.arguments) | set(kwargs)


def _wait_all(
    futures: Mapping[str, Future[Any]], error: BaseException | None = None
) -> dict[str, Any]:
    """Wait for every future (each carries its RPC timeout); then raise ``error`` or the first
    owner's error, if any."""
    wait_all(futures.values())
    results: dict[str, Any] = {}
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
