"""Compile a functional optimizer instance with TorchScript (its ``step`` then runs without the
GIL), where this torch can: :func:`torchscript_status` says (``docs/optim.md``)."""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any

import torch
from torch import Tensor

from metadist._quiet import quiet_torch_warnings
from metadist.optim import functional
from metadist.optim.functional import FunctionalOptimizer, FunctionalSGD

__all__ = ["ScriptedFunctionalOptimizer", "script_functional_optimizer", "torchscript_status"]

# torch's compiler is not thread-safe.
_compile_lock = threading.Lock()
FIX = "Step it eagerly instead (its step(), or DistributedOptimizer(..., mode='eager' or 'auto'))"


def _source(optim: FunctionalOptimizer) -> str:
    """The step of ``optim``'s class as TorchScript source: TorchScript calls take no ``**kwargs``,
    so the call of the kernel is written out from its signature (:func:`functional.plan`)."""
    _, names, lazy, keywords = functional.plan(optim.kind)
    stored = [n for n in names if n != lazy]
    switches = [optim.switches.get(n, "") for n in stored]
    fills = [f'd["{optim.fills[n]}"]' if n in optim.fills else "0.0" for n in stored]
    args = ["bufs" if n == lazy else f"s[{stored.index(n)}]" for n in names]
    special = {
        "has_complex": "cplx",
        "has_sparse_grad": "sparse",
        "weight_decay_type": "wd_type(f)",
    }
    for k in keywords:
        source = "d" if k in optim.defaults else "f" if k in optim.flags else None
        if source or k in special:
            args.append(f'{k}={source}["{k}"]' if source else f"{k}={special[k]}")
    lines = [
        "def step(params: List[Tensor], gradients: List[Optional[Tensor]], "
        "state: Dict[Tensor, Dict[str, Tensor]], d: Dict[str, float], f: Dict[str, bool]):",
        f"    used = active({switches!r}, d, f)",
        f"    kept, grads, s, cplx, sparse = collect(params, gradients, state, {stored!r}, used, "
        f"[{', '.join(fills)}], False)",
        f"    bufs = lazy(kept, state, {lazy!r})" if lazy else "",
        "    with torch.no_grad():",
        f"        kernel(kept, grads, {', '.join(args)})",
    ]
    if lazy:
        lines.append(f"    if active([{optim.switches[lazy]!r}], d, f)[0]:")
        lines.append(f"        keep(kept, bufs, state, {lazy!r})")
    return "\n".join(line for line in lines if line) + "\n"


@functools.cache
def _compile(cls: Any, source: str) -> tuple[Any, str | None]:
    """``(compiled step, None)`` or ``(None, why not)`` for one of metadist's classes, once per
    class."""
    try:
        with _compile_lock, quiet_torch_warnings():
            env = {**vars(functional), "kernel": functional.plan(cls.kind).kernel, "torch": torch}
            unit = torch.jit.CompilationUnit()
            unit.define(source, rcb=env.get)
            return unit.step, None
    except Exception as exc:
        return None, _why(cls, exc)


def _why(cls: type, exc: Exception) -> str:
    # TorchScript's first line says what failed; a later one names the function it was in.
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or ["?"]
    where = next((line for line in lines if "is being compiled" in line), "")
    return (
        f"TorchScript in torch {torch.__version__} cannot compile {cls.__name__} "
        f"({type(exc).__name__}: {lines[0]}{' ' + where if where else ''})"
    )


# Classes torch failed to compile, and why: it cannot compile a class again after a failure.
_failed: dict[type, str] = {}


def _script(optim: Any) -> Any:
    """The scripted :class:`ScriptedFunctionalOptimizer` of ``optim``; ``RuntimeError(why not)``."""
    cls: Any = type(optim)
    mine = isinstance(optim, FunctionalOptimizer)
    compiled, problem = _compile(cls, _source(optim)) if mine else (None, None)
    problem = problem or _failed.get(cls)
    if problem is None and not callable(getattr(torch.jit, "script", None)):
        problem = f"torch {torch.__version__} has no torch.jit.script"
    if problem is None:
        try:
            with _compile_lock, quiet_torch_warnings():
                return torch.jit.script(ScriptedFunctionalOptimizer(optim, compiled))
        except Exception as exc:
            problem = _failed[cls] = _why(cls, exc)
    raise RuntimeError(problem)


@functools.cache
def torchscript_status(functional_class: Any = FunctionalSGD) -> tuple[bool, str | None]:
    """Whether :func:`script_functional_optimizer` compiles instances of ``functional_class`` here
    (tried once per process and class on a one-element instance), and why ``"auto"`` should not
    pick it (deprecated, say).

    Args:
        functional_class: One of metadist's functional classes. For any other class this says
            whether TorchScript works here at all (on :class:`FunctionalSGD`); whether the class
            itself compiles shows when an instance is scripted.

    Returns:
        ``(works, problem)``: ``problem`` is ``None`` or a sentence naming the torch version.
    """
    if not issubclass(functional_class, FunctionalOptimizer):
        functional_class = FunctionalSGD
    try:
        _script(_instance(functional_class))
    except RuntimeError as exc:
        return False, str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.jit.script(_probe)  # for the notice torch gives at every call
    if any("deprecated" in str(w.message) for w in caught):
        return True, f"torch {torch.__version__} deprecates TorchScript"
    return True, None


def forget() -> None:
    """Forget what :func:`torchscript_status` found (for tests that change ``torch.jit``)."""
    torchscript_status.cache_clear()
    _compile.cache_clear()
    _failed.clear()


def _probe(x: Tensor) -> Tensor:
    return x


def _instance(cls: type) -> FunctionalOptimizer:
    """A one-element instance of one of metadist's classes (FunctionalQHM's needs values)."""
    needed = {"lr": 0.1, "momentum": 0.5, "nu": 0.5} if cls is functional.FunctionalQHM else {}
    return cls([torch.zeros(1)], **needed)


class ScriptedFunctionalOptimizer(torch.nn.Module):
    """A functional optimizer instance held in TorchScript (build it, and see what it raises, with
    :func:`script_functional_optimizer`).

    Args:
        optim: A functional optimizer instance (``step(gradients)``, ``state``, ``defaults``).
        compiled: The step compiled for its class (metadist's classes), or ``None`` (a user's
            class, compiled as a TorchScript class with the module).
    """

    def __init__(self, optim: Any, compiled: Any = None) -> None:
        super().__init__()
        if compiled is None:
            self.optim = optim
            return
        # metadist's classes share one step through inheritance and call their kernels with
        # **kwargs, which TorchScript cannot compile: the module holds their containers, typed,
        # and the step compiled for their class.
        self.run, self.params = compiled, optim.params
        self.state: Any = torch.jit.Attribute(optim.state, dict[Tensor, dict[str, Tensor]])
        self.defaults: Any = torch.jit.Attribute(optim.defaults, dict[str, float])
        self.flags: Any = torch.jit.Attribute(optim.flags, dict[str, bool])

    # hasattr(self, "run") is decided at compile time: only the branch that applies compiles.
    @torch.jit.export
    def step(self, gradients: list[Tensor | None]) -> None:
        """Step the held optimizer.

        Args:
            gradients: One per parameter, in order; ``None`` skips it.
        """
        if hasattr(self, "run"):
            self.run(self.params, gradients, self.state, self.defaults, self.flags)
        else:
            self.optim.step(gradients)

    @torch.jit.export
    def get_state(self) -> dict[Tensor, dict[str, Tensor]]:
        """Return the held optimizer's state.

        Returns:
            ``{parameter: {name: tensor}}`` (the live tensors).
        """
        return self.state if hasattr(self, "run") else self.optim.state

    @torch.jit.export
    def set_state(self, state: dict[Tensor, dict[str, Tensor]]) -> None:
        """Replace the held optimizer's state.

        Args:
            state: ``{parameter: {name: tensor}}``; ``{}`` starts every parameter afresh.
        """
        if hasattr(self, "run"):
            self.state = state
        else:
            self.optim.state = state

    @torch.jit.export
    def get_defaults(self) -> dict[str, float]:
        """Return the held optimizer's float hyperparameters.

        Returns:
            ``{name: value}``.
        """
        return self.defaults if hasattr(self, "run") else self.optim.defaults

    @torch.jit.export
    def set_defaults(self, defaults: dict[str, float]) -> None:
        """Replace the held optimizer's float hyperparameters.

        Args:
            defaults: ``{name: value}`` (a scheduler's new ``lr``, ...).
        """
        if hasattr(self, "run"):
            self.defaults = defaults
        else:
            self.optim.defaults = defaults


def script_functional_optimizer(optim: Any) -> Any:
    """Compile ``optim`` (a functional optimizer instance) with TorchScript.

    Args:
        optim: An instance of a TorchScript-compatible functional optimizer built with
            ``foreach=False`` and ``fused=False``.

    Returns:
        A scripted :class:`ScriptedFunctionalOptimizer`.

    Raises:
        TypeError: If ``optim`` is not a functional optimizer instance (checked before compiling).
        ValueError: If ``optim`` was built with ``foreach=True`` or ``fused=True``.
        RuntimeError: If this torch cannot compile its class (naming the version and the fix).
    """
    expected = "a functional optimizer instance (step(gradients), state and defaults dicts)"
    if isinstance(optim, type):
        raise TypeError(f"optim must be {expected}, got the class {optim.__name__}; create one")
    if isinstance(optim, torch.optim.Optimizer):
        raise TypeError(
            f"optim must be {expected}, got the torch.optim.Optimizer {type(optim).__name__}, "
            "which reads .grad; use its functional twin (see get_functional_optimizer)"
        )
    has = {"step": callable(getattr(optim, "step", None))}
    has.update({k: isinstance(getattr(optim, k, None), dict) for k in ("state", "defaults")})
    if lacking := [name for name, ok in has.items() if not ok]:
        raise TypeError(
            f"optim must be {expected}, got {optim!r:.100} of type {type(optim).__name__}, "
            f"which has no {' / '.join(lacking)}"
        )
    for flag in ("foreach", "fused"):
        if getattr(optim, flag, False) is True:
            raise ValueError(
                f"optim was built with {flag}=True, which TorchScript cannot run; build it with "
                f"{flag}=False to script it"
            )
    try:
        return _script(optim)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot script {type(optim).__name__}: {exc}. {FIX}") from None
