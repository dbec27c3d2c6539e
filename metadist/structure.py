"""The module-structure cache: each module's structure travels to a worker once.

On the caller, a *send plan* per ``nn.Module`` argument: the module tree pickled with every
parameter and buffer left out (its *structure*, keyed by a fingerprint of those bytes), and
where each parameter and buffer goes. A plan is rebuilt only when the module's structure
changes (checked on every call, cheaply); the structure bytes travel with every call to a worker
until a call carrying them has succeeded there. On the worker, a *rebuilder* per fingerprint
makes a fresh module object per call from the call's tensors (RPC handlers run concurrently).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import pickle
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from itertools import repeat
from operator import is_
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "STRUCTURE_CACHE_SIZE",
    "SendPlan",
    "clear_module_cache",
    "invalidate_module_cache",
    "is_confirmed",
    "mark_structure_confirmed",
    "plan_for",
    "rebuilder",
]

#: How many module structures a worker keeps (least recently used are evicted).
STRUCTURE_CACHE_SIZE = 1024

# (slot name, index into the unique tensor list or -1 for None)
_Slots = tuple[tuple[str, int], ...]
# Per module: parameter slots, buffer slots, child slots (index into the module list or -1).
_Spec = tuple[_Slots, _Slots, _Slots]

# Where a plain attribute refers to what the tree registers: (_MODULE, _PARAMETER or _BUFFER,
# index into the module, parameter or buffer list), or, for a list, tuple or dict, the recipes of
# the positions (indices or keys) that hold such references, or, for a set, a list (_Scan.walk).
_Recipe = tuple[Any, ...] | dict[Any, Any] | list[Any]
_MODULE = 0
_PARAMETER = 1
_BUFFER = 2
_METHOD = 3  # a method bound to a registered module (a hook: register_forward_hook(self.f))
_PARTIAL = 4  # a functools.partial of such references: (_PARTIAL, func's, args', keywords')

# Per module, every slot that decides the plan's shape, in order: parameter names and the object
# in each slot (identity also decides which slots share a tensor), buffer names and which are
# None (buffers are read by name per call, so replacing one needs no new plan), child names and
# the child in each slot, and the module's hooks (their handles' ids: see _hook_ids).
_SlotIdentity = tuple[
    tuple[str, ...],
    tuple[nn.Parameter | None, ...],
    tuple[str, ...],
    tuple[bool, ...],
    tuple[str, ...],
    tuple[nn.Module | None, ...],
    tuple[int, ...],
]


def _hook_ids(m: nn.Module) -> tuple[int, ...]:
    """The ids of the module's forward and backward hooks: a hook registered or removed since the
    plan was made changes them, and the structure, which carries the hooks, is sent again. Each
    registration, of any hook anywhere, takes the next ``RemovableHandle.next_id``: while it
    stays, only a removal can have changed them, on a module that had hooks."""
    # Ids are unique across every dict (one counter): no separators needed, and () when none.
    return (*m._forward_pre_hooks, *m._forward_hooks, *m._backward_pre_hooks, *m._backward_hooks)


class SendPlan:
    """How one module travels: its structure's bytes and fingerprint, what to read per call."""

    __slots__ = (
        "buffer_reads",
        "buffer_ties",
        "checks",
        "fingerprint",
        "hook_count",
        "param_reads",
        "pinned_buffers",
        "structure",
        "submodules",
    )

    def __init__(self, module: nn.Module, describe: Callable[[], str]) -> None:
        self.hook_count = RemovableHandle.next_id  # read first: a later hook compares all
        modules = list(module.modules())
        index = {id(m): i for i, m in enumerate(modules)}
        params: list[torch.Tensor] = []
        buffers: list[torch.Tensor] = []
        # Indices into params / buffers by tensor id; separate, since a parameter may also be
        # registered as a buffer (an index into one list means nothing in the other).
        seen: dict[int, int] = {}
        seen_buffers: dict[int, int] = {}
        # Modules are referred to by index into `modules`: the plan must not hold the root
        # module strongly (it is the value of a weak-keyed cache entry for that very module).
        param_reads: list[tuple[int, str, torch.Tensor]] = []
        buffer_reads: list[tuple[int, str]] = []
        specs: list[_Spec] = []
        checks: list[_SlotIdentity] = []
        # Buffer slots sharing the tensor of an earlier slot: (module, name, first module, name).
        buffer_ties: list[tuple[int, str, int, str]] = []
        for k, m in enumerate(modules):
            p_slots: list[tuple[str, int]] = []
            for name, p in m._parameters.items():
                if p is None:
                    p_slots.append((name, -1))
                    continue
                j = seen.get(id(p))
                if j is None:  # first occurrence; tied parameters share an index
                    j = seen[id(p)] = len(params)
                    params.append(p)
                    param_reads.append((k, name, p))
                p_slots.append((name, j))
            b_slots: list[tuple[str, int]] = []
            for name, b in m._buffers.items():
                if b is None:
                    b_slots.append((name, -1))
                    continue
                j = seen_buffers.get(id(b))
                if j is None:
                    j = seen_buffers[id(b)] = len(buffers)
                    buffers.append(b)
                    buffer_reads.append((k, name))
                else:
                    buffer_ties.append((k, name, *buffer_reads[j]))
                b_slots.append((name, j))
            c_slots = tuple(
                (name, -1 if c is None else index[id(c)]) for name, c in m._modules.items()
            )
            specs.append((tuple(p_slots), tuple(b_slots), c_slots))
            checks.append(
                (
                    tuple(m._parameters),
                    tuple(m._parameters.values()),
                    tuple(m._buffers),
                    tuple(b is None for b in m._buffers.values()),
                    tuple(m._modules),
                    tuple(m._modules.values()),
                    _hook_ids(m),
                )
            )
        # Everything the tree registers, by identity; a parameter also registered as a buffer
        # is the parameter (the worker's nn.Parameter leaf).
        known: dict[int, tuple[int, int]] = {id(b): (_BUFFER, j) for j, b in enumerate(buffers)}
        known.update({id(p): (_PARAMETER, j) for j, p in enumerate(params)})
        known.update({id(m): (_MODULE, k) for k, m in enumerate(modules)})
        # The skeleton: a deep copy with every parameter and buffer replaced by None (the memo
        # makes deepcopy return None for them instead of copying their data).
        memo: dict[int, Any] = {id(t): None for t in (*params, *buffers)}
        scan = _Scan(known, memo)
        aliases = scan.attributes(modules, lambda: f"{describe()} ({type(module).__qualname__})")
        try:
            skeleton = copy.deepcopy(module, memo)
            for m in skeleton.modules():  # sent per call: keep it out of the fingerprint
                m.training = True
            shape = (skeleton, tuple(specs), tuple(aliases))
            structure = pickle.dumps(shape, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            raise TypeError(
                f"module argument {describe()} ({type(module).__qualname__}) cannot be "
                f"sent to other workers: pickling its structure failed with "
                f"{type(error).__name__}: {error}. "
                f"Its classes (and any hooks) must be defined at module level so that every "
                f"worker can import them"
            ) from error
        self.submodules = tuple(modules[1:])
        self.checks = tuple(checks)
        self.buffer_ties = tuple(buffer_ties)
        # Buffers a plain attribute refers to: the worker re-points it to the buffer read by name
        # per call, so a buffer replaced since (the attribute keeps the old one) needs a new plan.
        self.pinned_buffers = tuple(
            (*buffer_reads[j], buffers[j]) for j in sorted(scan.aliased_buffers)
        )
        self.param_reads = tuple(param_reads)
        self.buffer_reads = tuple(buffer_reads)
        self.structure = structure
        self.fingerprint = hashlib.blake2b(structure, digest_size=16).hexdigest()

    def still_valid(self, modules: tuple[nn.Module, ...]) -> bool:
        """Whether every slot the plan depends on is as it was (else the structure is sent
        again); O(#slots) with C-level loops (``map``): this runs on every call."""
        hook_count = RemovableHandle.next_id
        registered = hook_count != self.hook_count  # a hook somewhere since: compare every module
        for m, (p_names, p_objs, b_names, b_none, c_names, c_objs, hooks) in zip(
            modules, self.checks, strict=True
        ):
            buffers = m._buffers
            if not (
                _same(m._parameters, p_names, p_objs)
                and _same(m._modules, c_names, c_objs)
                and tuple(buffers) == b_names
                and tuple(map(is_, buffers.values(), repeat(None))) == b_none
            ):
                return False
            if (registered or hooks) and _hook_ids(m) != hooks:
                return False
        self.hook_count = hook_count
        return all(
            modules[k]._buffers.get(name) is modules[k0]._buffers.get(name0)
            for k, name, k0, name0 in self.buffer_ties
        ) and (
            not self.pinned_buffers
            or all(modules[k]._buffers.get(name) is b for k, name, b in self.pinned_buffers)
        )


# A module's own dicts of what it registered; every other attribute is captured with its structure.
_REGISTERED = frozenset({"_parameters", "_buffers", "_modules"})


class _RefusedError(Exception):
    """What a plain module attribute holds that a worker's copy could not reproduce."""


_UNREGISTERED = (
    "a {} that is not registered as a submodule and holds a parameter that requires grad or "
    "refers to the registered modules or tensors: a worker's copy would keep its values of the "
    "first call and lose its gradients. Register it (assign it as an attribute; nn.ModuleList "
    "or nn.ModuleDict for a list or dict), or pass it as an argument (a reference back to a "
    "module that holds this one: pass that module, with this one inside it; a fixed module: "
    "freeze it with requires_grad_(False), and call metadist.invalidate_module_cache after "
    "changing its values)"
)


class _Scan:
    """Walks a module's plain attributes (into lists, tuples, dicts, sets and unregistered
    modules): records where they refer to the tree's registered modules, parameters and buffers,
    and refuses what a worker's copy would silently get wrong."""

    __slots__ = ("aliased_buffers", "done", "known", "memo")

    def __init__(self, known: dict[int, tuple[int, int]], memo: dict[int, Any]) -> None:
        self.known = known
        self.memo = memo
        self.aliased_buffers: set[int] = set()
        # Containers and modules already walked (a list that holds itself, a shared one).
        self.done: dict[int, _Recipe | None] = {}

    def attributes(
        self, modules: list[nn.Module], describe: Callable[[], str]
    ) -> list[tuple[int, str, _Recipe]]:
        """Walk every module's plain attributes: ``(module, attribute, recipe)`` for those that
        refer to what the tree registers; ``TypeError`` naming the argument (``describe()``)."""
        aliases = []
        for k, m in enumerate(modules):
            for attr, value in vars(m).items():
                if attr in _REGISTERED:
                    continue
                try:
                    recipe = self.walk(value)
                except _RefusedError as refused:
                    raise TypeError(
                        f"module argument {describe()}: attribute {attr!r} of its "
                        f"{type(m).__qualname__} holds {refused}"
                    ) from None
                # An RNN's list of its own weights is refreshed by _init_flat_weights (which
                # also remakes its weak references and flattens the weights on CUDA).
                if recipe is not None and not (
                    isinstance(m, nn.RNNBase) and attr == "_flat_weights"
                ):
                    aliases.append((k, attr, recipe))
        return aliases

    def walk(self, value: Any) -> _Recipe | None:
        """How to re-point ``value`` on the worker; None where it refers to nothing registered."""
        alias = self.known.get(id(value))
        if alias is not None:
            if alias[0] == _BUFFER:
                self.aliased_buffers.add(alias[1])
            return alias
        if isinstance(value, torch.Tensor):
            if value.grad_fn is not None:
                # Computed from the parameters (weight_norm's ``weight``): not a leaf, cannot
                # be deep-copied; its value is recomputed before each forward, so the skeleton
                # keeps a detached copy.
                self.memo[id(value)] = value.detach()
            elif value.requires_grad:
                raise _RefusedError(
                    "a tensor that requires grad but is neither a registered parameter nor a "
                    "buffer: a worker's copy would keep its value of the first call and lose its "
                    "gradient. Register it as an nn.Parameter (nn.ParameterList for a list), or "
                    "pass it as an argument"
                )
            return None
        if isinstance(value, types.MethodType):
            owner = self.known.get(id(value.__self__))
            return (_METHOD, owner[1]) if owner is not None and owner[0] == _MODULE else None
        if isinstance(value, functools.partial):
            parts = (self.walk(value.func), self.walk(value.args), self.walk(value.keywords))
            return None if parts == (None, None, None) else (_PARTIAL, *parts)
        if not isinstance(value, (dict, list, tuple, set, frozenset, nn.Module)):
            return None
        if id(value) in self.done:
            return self.done[id(value)]
        if isinstance(value, nn.Module):
            self.done[id(value)] = None
            self._unregistered(value)
            return None
        if isinstance(value, (set, frozenset)):
            # Its members' references (a set holds no list or dict), then its other members:
            # the worker makes the set anew from both, so its identity-based lookups hold.
            found = {id(v): self.walk(v) for v in value}
            members = [r for r in found.values() if r is not None]
            if any(not isinstance(r, tuple) or r[0] >= _METHOD for r in members):
                raise _RefusedError(
                    "a set holding a tuple or a method that refers to registered modules or "
                    "tensors, which a worker's copy cannot re-point: hold them in a list"
                )
            others = [v for v in value if found[id(v)] is None]
            recipe_of_set = [members, others] if members else None
            self.done[id(value)] = recipe_of_set
            return recipe_of_set
        # Registered before it is filled: a container met again (shared, or holding itself)
        # gets the same recipe, and the worker the same copy (_repoint's ``made``).
        recipe: dict[Any, _Recipe] = {}
        self.done[id(value)] = recipe
        for key, v in value.items() if isinstance(value, dict) else enumerate(value):
            r = self.walk(v)
            if r is not None:
                recipe[key] = r
        if not recipe:
            self.done[id(value)] = None
            return None
        return recipe

    def _unregistered(self, module: nn.Module) -> None:
        """Refuse a module outside the tree whose copy would be stale or point into the tree."""
        refused = _RefusedError(_UNREGISTERED.format(type(module).__qualname__))
        for m in module.modules():
            tensors = (*m._parameters.values(), *m._buffers.values())
            if id(m) in self.known or any(
                t is not None and (t.requires_grad or id(t) in self.known) for t in tensors
            ):
                raise refused
            for attr, value in vars(m).items():
                if attr not in _REGISTERED and self.walk(value) is not None:
                    raise refused


def _repoint(
    value: Any, recipe: _Recipe, sources: tuple[list[Any], ...], made: dict[int, Any]
) -> Any:
    """The skeleton's attribute ``value`` with the references of ``recipe`` taken from
    ``sources`` (this call's fresh modules, parameters, buffers); the skeleton's is unchanged.
    ``made`` maps each container copied so far to its copy, so that sharing survives."""
    if isinstance(recipe, tuple):
        if recipe[0] == _METHOD:
            return types.MethodType(value.__func__, sources[_MODULE][recipe[1]])
        if recipe[0] == _PARTIAL:
            func, args, keywords = (
                part if r is None else _repoint(part, r, sources, made)
                for part, r in zip(
                    (value.func, value.args, value.keywords), recipe[1:], strict=True
                )
            )
            return functools.partial(func, *args, **keywords)
        return sources[recipe[0]][recipe[1]]
    out = made.get(id(value))
    if out is not None:
        return out
    if isinstance(recipe, list):  # a set: its other members, and its references made anew
        members, others = recipe
        out = type(value)([*others, *(_repoint(None, r, sources, made) for r in members)])
        made[id(value)] = out
        return out
    if isinstance(value, tuple):
        items = [
            _repoint(v, recipe[i], sources, made) if i in recipe else v for i, v in enumerate(value)
        ]
        out = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    else:
        out = made[id(value)] = copy.copy(value)  # a list or dict of the same class
        for key, r in recipe.items():
            out[key] = _repoint(value[key], r, sources, made)
    made[id(value)] = out
    return out


def _same(slots: dict[str, Any], names: tuple[str, ...], objects: tuple[Any, ...]) -> bool:
    """The same names in the same order, holding the same objects."""
    return (
        len(slots) == len(names)
        and all(map(is_, slots.values(), objects))
        and tuple(slots) == names
    )


_PLANS: weakref.WeakKeyDictionary[nn.Module, SendPlan] = weakref.WeakKeyDictionary()
_PLANS_LOCK = threading.Lock()

# Structures each worker has confirmed (a call that carried them succeeded), per running world:
# {world token: {worker name: {fingerprint}}}. Concurrent first calls all carry the structure.
_CONFIRMED: dict[object, dict[str, set[str]]] = {}


def invalidate_module_cache(module: nn.Module) -> None:
    """Forget the cached structure of ``module`` (and its submodules' own entries).

    Structural changes (adding, removing, renaming or replacing submodules, parameters or
    buffers, or setting one that was ``None``) are detected automatically; call this after
    changing a non-tensor attribute such as ``dropout.p`` (or a hook) so that workers see the
    new value. The ``training`` flag is sent on every call and needs no invalidation.

    Args:
        module: The caller's module.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"invalidate_module_cache: module must be an nn.Module, got {module!r}")
    with _PLANS_LOCK:
        for m in module.modules():
            _PLANS.pop(m, None)


def clear_module_cache() -> None:
    """Forget every cached structure on this worker, as caller and as worker."""
    with _PLANS_LOCK:
        _PLANS.clear()
        _CONFIRMED.clear()
    with _STRUCTURES_LOCK:
        _STRUCTURES.clear()


def plan_for(
    module: nn.Module, describe: Callable[[], str]
) -> tuple[SendPlan, tuple[nn.Module, ...]]:
    """The module's plan (made or remade if its structure changed) and its module list;
    ``describe()`` names the argument in an error."""
    plan = _PLANS.get(module)
    if plan is not None:
        modules = (module, *plan.submodules)
        if plan.still_valid(modules):
            return plan, modules
    plan = SendPlan(module, describe)
    with _PLANS_LOCK:
        _PLANS[module] = plan
    return plan, (module, *plan.submodules)


def mark_structure_confirmed(world: object, worker: str, fingerprints: tuple[str, ...]) -> None:
    """Record that ``worker`` has cached ``fingerprints`` in the running ``world``."""
    if fingerprints:
        _CONFIRMED.setdefault(world, {}).setdefault(worker, set()).update(fingerprints)


def is_confirmed(world: object, worker: str, fingerprint: str) -> bool:
    """Whether ``worker`` has cached ``fingerprint`` in the running ``world``."""
    per_world = _CONFIRMED.get(world)
    if per_world is None:
        if _CONFIRMED:  # a previous world's confirmations are meaningless now
            _CONFIRMED.clear()
        return False
    known = per_world.get(worker)
    return known is not None and fingerprint in known


class Rebuilder:
    """What a worker needs to build a fresh module per call from a cached structure."""

    __slots__ = ("aliases", "bases", "classes", "specs")

    def __init__(
        self,
        skeleton: nn.Module,
        specs: tuple[_Spec, ...],
        aliases: tuple[tuple[int, str, _Recipe], ...],
    ) -> None:
        modules = list(skeleton.modules())
        skip = _REGISTERED | {"training"}
        self.classes = tuple(type(m) for m in modules)
        self.bases = tuple({k: v for k, v in m.__dict__.items() if k not in skip} for m in modules)
        self.specs = specs
        self.aliases = aliases

    def build(
        self, params: list[torch.Tensor], buffers: list[torch.Tensor | None], training: int
    ) -> nn.Module:
        fresh = [cls.__new__(cls) for cls in self.classes]
        for i, (module, base, (p_slots, b_slots, c_slots)) in enumerate(
            zip(fresh, self.bases, self.specs, strict=True)
        ):
            state = dict(base)  # shallow: non-tensor attributes are shared, read-only
            state["_parameters"] = {n: (params[j] if j >= 0 else None) for n, j in p_slots}
            state["_buffers"] = {n: (buffers[j] if j >= 0 else None) for n, j in b_slots}
            state["_modules"] = {n: (fresh[j] if j >= 0 else None) for n, j in c_slots}
            state["training"] = bool(training >> i & 1)
            object.__setattr__(module, "__dict__", state)
            if isinstance(module, nn.RNNBase):
                # An RNN's list of its weights (``_flat_weights``), from this call's tensors.
                module._init_flat_weights()
        if self.aliases:
            # Plain attributes referring to registered modules, parameters or buffers
            # (``self.blocks = [self.l1, self.l2]``) refer to this call's.
            sources = (fresh, params, buffers)
            made: dict[int, Any] = {}
            for k, attr, recipe in self.aliases:
                vars(fresh[k])[attr] = _repoint(self.bases[k][attr], recipe, sources, made)
        return fresh[0]


_STRUCTURES: OrderedDict[str, Rebuilder] = OrderedDict()
_STRUCTURES_LOCK = threading.Lock()


def rebuilder(fingerprint: str, structure: bytes | None) -> Rebuilder:
    """The worker's rebuilder for ``fingerprint``, made from ``structure`` if not cached."""
    with _STRUCTURES_LOCK:
        cached = _STRUCTURES.get(fingerprint)
        if cached is not None:
            _STRUCTURES.move_to_end(fingerprint)
            return cached
    if structure is None:
        raise RuntimeError(
            f"module structure {fingerprint} is not cached on this worker (it keeps the "
            f"{STRUCTURE_CACHE_SIZE} most recently used structures); call "
            f"metadist.clear_module_cache() on the caller to resend structures"
        )
    made = Rebuilder(*pickle.loads(structure))
    with _STRUCTURES_LOCK:
        _STRUCTURES[fingerprint] = made
        while len(_STRUCTURES) > STRUCTURE_CACHE_SIZE:
            _STRUCTURES.popitem(last=False)
    return made
