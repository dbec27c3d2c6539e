"""How arguments and results travel: modules by cached structure, leaves, compression.

metadist never pickles a module as is. For each ``nn.Module`` argument it sends

* once per worker, the module's *structure*: the module tree pickled with every parameter and
  buffer left out (cached on the worker, keyed by a fingerprint of those bytes; the caller keeps
  the bytes and sends them again only when the module's structure changes), and
* on every call, the parameter tensors (small modules' packed into one flat tensor), the
  buffers, and the ``training`` flag of every submodule.

The worker rebuilds a fresh module object per call (RPC handlers run concurrently). Outside a
distributed autograd context everything travels detached and :func:`decode` makes the
parameters ``nn.Parameter`` leaves and the tensors that required grad leaf tensors again,
listing them in the order of :func:`encode`'s ``sources``: the worker differentiates with
respect to them (:mod:`metadist.worker`). Inside a context (``attached``), parameters travel as
plain-tensor views that distributed autograd records instead, since torch rebuilds a pickled
``nn.Parameter`` as a new leaf it never links to the caller's. Buffers always travel detached
(remote buffer updates, e.g. BatchNorm running statistics, are not sent back). With compression
(``"bf16"`` or ``"fp16"``), floating-point tensors are cast for the wire, gradients too, and
cast back on arrival.

Non-tensor attributes of a module (e.g. ``dropout.p``) are captured when its structure is first
sent; call :func:`invalidate_module_cache` after changing them.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import pickle
import threading
import weakref
from collections import OrderedDict
from itertools import repeat
from operator import is_
from typing import Any

import numpy
import torch
from torch import nn

from metadist._pytree import (
    argument_path,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)

__all__ = [
    "STRUCTURE_CACHE_SIZE",
    "CallMemo",
    "clear_module_cache",
    "compress_tree",
    "decode",
    "decompress_tree",
    "encode",
    "invalidate_module_cache",
    "mark_structure_confirmed",
    "check_sendable",
    "resolve_compression",
    "wire_bytes",
]

#: How many module structures a worker keeps (least recently used are evicted).
STRUCTURE_CACHE_SIZE = 1024

_COMPRESSION = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def resolve_compression(compression: str | None) -> torch.dtype | None:
    """The wire dtype of a ``compression`` argument (``None``: none); ``ValueError`` otherwise.

    Example:
        >>> resolve_compression("bf16")
        torch.bfloat16
    """
    if compression is None:
        return None
    dtype = _COMPRESSION.get(compression) if isinstance(compression, str) else None
    if dtype is None:
        raise ValueError(f"compression must be None, 'bf16' or 'fp16', got {compression!r}")
    return dtype


# --------------------------------------------------------------------------------------------------
# Wire objects (pickled by RPC; tensors inside go through RPC's tensor channel)


class _Wire:
    """Base of the wire objects: pickled positionally, smaller and faster to unpickle than the
    default for slotted classes (a dict of slot names)."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        names: tuple[str, ...] = self.__slots__  # the subclass's fields, in order
        return (type(self), tuple(getattr(self, name) for name in names))


@dataclasses.dataclass(slots=True)
class _Compressed(_Wire):
    """A floating-point tensor cast to the wire dtype, with its original dtype."""

    tensor: torch.Tensor
    dtype: torch.dtype


@dataclasses.dataclass(slots=True)
class _GradLeaf(_Wire):
    """A tensor that requires grad, travelling detached (outside a distributed autograd context).

    RPC sends tensors without their ``requires_grad`` flag; the worker makes it a leaf that
    requires grad again (also under the caller's ``torch.no_grad()``, for an inner loop that
    differentiates locally inside the remote function, as it would locally).
    """

    tensor: torch.Tensor | _Compressed


@dataclasses.dataclass(slots=True)
class _Packed(_Wire):
    """Several parameters of one dtype as one flat tensor, with the shape of each.

    Inside a distributed autograd context each tensor of a message costs its own bookkeeping on
    both sides, forward and backward: packed, the 25-task step of ``bench_phases.py --form
    context`` takes 9.1 ms against 10.0 unpacked. Outside contexts it makes no difference
    measured, and the worker's answers travel unpacked.
    """

    flat: torch.Tensor | _Compressed
    shapes: tuple[torch.Size, ...]


#: Modules whose parameters total at most this many bytes send them packed (see _Packed); the
#: copy into one buffer costs more than it saves for large models.
PACK_BYTES = 4 << 20


def _packable(tensors: list[torch.Tensor]) -> bool:
    """Several dense tensors of one dtype, small enough that one copy costs less than many."""
    return (
        len(tensors) >= 2
        and len({t.dtype for t in tensors}) == 1
        and all(t.layout == torch.strided for t in tensors)
        and sum(t.numel() for t in tensors) * tensors[0].element_size() <= PACK_BYTES
    )


@dataclasses.dataclass(slots=True)
class _ModuleRef(_Wire):
    """A module on the wire: structure fingerprint (+ bytes if not cached yet) and its tensors."""

    fingerprint: str
    structure: bytes | None
    params: tuple[torch.Tensor | _Compressed, ...] | _Packed
    buffers: tuple[torch.Tensor | _Compressed | None, ...]
    training: int
    requires_grad: int


# --------------------------------------------------------------------------------------------------
# Caller side: a plan per module, rebuilt only when the module's structure changes

# (slot name, index into the unique tensor list or -1 for None)
_Slots = tuple[tuple[str, int], ...]
# Per module: parameter slots, buffer slots, child slots (index into the module list or -1).
_Spec = tuple[_Slots, _Slots, _Slots]


# Where a module sits in the arguments: (args, kwargs, leaf index); named only on errors.
_ArgPosition = tuple[tuple[Any, ...], dict[str, Any], int]

# Per module, every slot that decides the plan's shape, in order: parameter names and the object
# in each slot (identity also decides which slots share a tensor), buffer names and which are
# None (buffers are read by name per call, so replacing one needs no new plan), child names and
# the child in each slot.
_SlotIdentity = tuple[
    tuple[str, ...],
    tuple[nn.Parameter | None, ...],
    tuple[str, ...],
    tuple[bool, ...],
    tuple[str, ...],
    tuple[nn.Module | None, ...],
]


class _SendPlan:
    __slots__ = (
        "buffer_reads",
        "buffer_ties",
        "checks",
        "fingerprint",
        "param_reads",
        "structure",
        "submodules",
    )

    def __init__(self, module: nn.Module, where: _ArgPosition) -> None:
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
        first_buffer: dict[int, tuple[int, str]] = {}
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
                    first_buffer[id(b)] = (k, name)
                else:
                    buffer_ties.append((k, name, *first_buffer[id(b)]))
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
                )
            )
        # The skeleton: a deep copy with every parameter and buffer replaced by None (the memo
        # makes deepcopy return None for them instead of copying their data).
        memo: dict[int, Any] = {id(t): None for t in (*params, *buffers)}
        for m in modules:
            # A tensor attribute computed from the parameters (weight_norm's ``weight``) is not
            # a leaf and cannot be deep-copied; its value is recomputed before each forward,
            # so the skeleton keeps a detached copy.
            for value in vars(m).values():
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    memo[id(value)] = value.detach()
        try:
            skeleton = copy.deepcopy(module, memo)
            for m in skeleton.modules():  # sent per call: keep it out of the fingerprint
                m.training = True
            structure = pickle.dumps((skeleton, tuple(specs)), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            raise TypeError(
                f"module argument {_leaf_name(*where)} ({type(module).__qualname__}) cannot be "
                f"sent to other workers: pickling its structure failed with "
                f"{type(error).__name__}: {error}. "
                f"Its classes (and any hooks) must be defined at module level so that every "
                f"worker can import them"
            ) from error
        self.submodules = tuple(modules[1:])
        self.checks = tuple(checks)
        self.buffer_ties = tuple(buffer_ties)
        self.param_reads = tuple(param_reads)
        self.buffer_reads = tuple(buffer_reads)
        self.structure = structure
        self.fingerprint = hashlib.blake2b(structure, digest_size=16).hexdigest()

    def modules(self, root: nn.Module) -> tuple[nn.Module, ...]:
        """The module list (``root.modules()`` order) this plan was made for."""
        return (root, *self.submodules)

    def still_valid(self, modules: tuple[nn.Module, ...]) -> bool:
        """Cheap per-call check that every slot the plan depends on is as it was.

        Any difference (a slot added, removed, renamed or reordered, set or emptied; another
        parameter or child object; tied buffers untied) means the structure must be sent again.
        O(#slots) with C-level loops (``map``): this runs on every call.
        """
        for m, (p_names, p_objs, b_names, b_none, c_names, c_objs) in zip(
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
        return all(
            modules[k]._buffers.get(name) is modules[k0]._buffers.get(name0)
            for k, name, k0, name0 in self.buffer_ties
        )


def _same(slots: dict[str, Any], names: tuple[str, ...], objects: tuple[Any, ...]) -> bool:
    """The same names in the same order, holding the same objects."""
    return (
        len(slots) == len(names)
        and all(map(is_, slots.values(), objects))
        and tuple(slots) == names
    )


_PLANS: weakref.WeakKeyDictionary[nn.Module, _SendPlan] = weakref.WeakKeyDictionary()
_PLANS_LOCK = threading.Lock()

# Structures each worker has confirmed (a call that carried them succeeded), per running world:
# {world token: {worker name: {fingerprint}}}. A structure is sent with every call to a worker
# until a call carrying it has succeeded, so concurrent first calls never wait for each other.
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


def _plan_for(module: nn.Module, where: _ArgPosition) -> tuple[_SendPlan, tuple[nn.Module, ...]]:
    plan = _PLANS.get(module)
    if plan is not None:
        modules = plan.modules(module)
        if plan.still_valid(modules):
            return plan, modules
    plan = _SendPlan(module, where)
    with _PLANS_LOCK:
        _PLANS[module] = plan
    return plan, plan.modules(module)


def mark_structure_confirmed(world: object, worker: str, fingerprints: tuple[str, ...]) -> None:
    """Record that ``worker`` has cached ``fingerprints`` in the running ``world``."""
    if fingerprints:
        _CONFIRMED.setdefault(world, {}).setdefault(worker, set()).update(fingerprints)


def _is_confirmed(world: object, worker: str, fingerprint: str) -> bool:
    per_world = _CONFIRMED.get(world)
    if per_world is None:
        if _CONFIRMED:  # a previous world's confirmations are meaningless now
            _CONFIRMED.clear()
        return False
    known = per_world.get(worker)
    return known is not None and fingerprint in known


def _wire(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | _Compressed:
    """``tensor`` cast to the wire ``dtype`` (with its own dtype) where compression applies."""
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return _Compressed(tensor.to(dtype), tensor.dtype)
    return tensor


@dataclasses.dataclass(slots=True)
class CallMemo:
    """Per-call memo so that a module or parameter used by several partitions is encoded once."""

    modules: dict[int, tuple[_SendPlan, tuple[Any, ...]]] = dataclasses.field(default_factory=dict)
    tensors: dict[int, Any] = dataclasses.field(default_factory=dict)


def _encode_module(
    module: nn.Module,
    where: _ArgPosition,
    dtype: torch.dtype | None,
    memo: CallMemo,
    attached: bool,
) -> Any:
    cached = memo.modules.get(id(module))
    if cached is not None:
        return cached
    plan, modules = _plan_for(module, where)
    requires_grad = sum(1 << i for i, (_, _, p) in enumerate(plan.param_reads) if p.requires_grad)
    params: Any = _pack(plan, modules, dtype, attached)
    if params is None:
        params = []
        for k, _, p in plan.param_reads:
            if attached and p.requires_grad:
                # A non-leaf alias of the parameter is what distributed autograd records.
                # view_as is the cheapest, but its backward reshapes, which sparse gradients
                # (an nn.Embedding(sparse=True)) do not support; aten.alias passes them through.
                sparse = getattr(modules[k], "sparse", False) is True
                params.append(
                    _wire(torch.ops.aten.alias.default(p) if sparse else p.view_as(p), dtype)
                )
            else:
                params.append(_wire(p.detach(), dtype))
        params = tuple(params)
    buffers = tuple(
        None if (b := modules[k]._buffers.get(name)) is None else _wire(b.detach(), dtype)
        for k, name in plan.buffer_reads
    )
    training = sum(1 << i for i, m in enumerate(modules) if m.training)
    parts = (params, buffers, training, requires_grad)
    memo.modules[id(module)] = (plan, parts)
    return plan, parts


def _pack(
    plan: _SendPlan, modules: tuple[nn.Module, ...], dtype: torch.dtype | None, attached: bool
) -> Any:
    """The module's parameters as one :class:`_Packed` tensor, or ``None`` where that won't do."""
    tensors = [p for _, _, p in plan.param_reads]
    if not _packable(tensors):
        return None
    if any(getattr(m, "sparse", False) is True for m in modules):
        return None  # sparse gradients cannot flow through the flat buffer's views
    flat = torch.cat(
        [t.reshape(-1) if attached and t.requires_grad else t.detach().reshape(-1) for t in tensors]
    )
    return _Packed(_wire(flat, dtype), tuple(t.shape for t in tensors))


_SCALARS = (str, bytes, int, float, complex, bool, type(None))
# Leaves that cannot hold a tensor: no need to look inside them.
_PLAIN_LEAVES = (
    *_SCALARS,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    slice,
    range,
    type(Ellipsis),
    numpy.generic,
)


def _needs_encoding(obj: Any, dtype: torch.dtype | None, attached: bool) -> bool:
    """Whether ``obj`` holds a module, a parameter, a tensor that requires grad but travels
    detached, (with compression) a float tensor, or an object pytree cannot look into.

    A quick scan of plain containers; any other object answers True so that the full pytree
    walk decides.
    """
    if isinstance(obj, torch.Tensor):
        if isinstance(obj, nn.Parameter) or (obj.requires_grad and not attached):
            return True
        return dtype is not None and obj.is_floating_point() and obj.dtype != dtype
    kind = type(obj)
    # Explicit loops: this runs on every call and is faster than any() over a generator.
    if kind is tuple or kind is list:
        for item in obj:  # noqa: SIM110
            if _needs_encoding(item, dtype, attached):
                return True
        return False
    if kind is dict:
        for item in obj.values():  # noqa: SIM110
            if _needs_encoding(item, dtype, attached):
                return True
        return False
    if isinstance(obj, nn.Module):
        return True
    return not _is_plain(obj)


def _is_plain(obj: Any) -> bool:
    if isinstance(obj, _PLAIN_LEAVES):
        return True
    return isinstance(obj, numpy.ndarray) and obj.dtype != object


def _refuse_hidden_grad(obj: Any, where: _ArgPosition) -> None:
    """Raise if ``obj``, a leaf pytree cannot look into, holds a tensor that requires grad.

    RPC would pickle such a tensor detached, so its gradient (and its ``requires_grad`` flag)
    would be lost without a word. The scan pickles ``obj`` with every tensor replaced by a
    reference, so no tensor data is copied.
    """
    finder = _TensorFinder(io.BytesIO())
    try:
        finder.dump(obj)
    except Exception:
        return  # unpicklable: RPC itself reports it when sending
    if finder.found:
        raise TypeError(
            f"argument {_leaf_name(*where)} ({type(obj).__qualname__}) holds a tensor that "
            f"requires grad inside an object metadist cannot look into: it would arrive "
            f"detached and its gradient would be lost. Register the class as a pytree node "
            f"(torch.utils._pytree.register_dataclass for a dataclass, register_pytree_node "
            f"otherwise), pass the tensor as an argument of its own, or detach it if no "
            f"gradient is wanted"
        )


class _TensorFinder(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.found = False

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.found = self.found or obj.requires_grad
            return id(obj)
        return None


def _leaf_name(args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> str:
    pairs, _ = tree_flatten_with_path((args, kwargs))
    return argument_path(pairs[index][0])


def encode(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    world: object,
    worker: str,
    dtype: torch.dtype | None,
    memo: CallMemo,
    attached: bool = False,
) -> tuple[tuple[Any, ...], dict[str, Any], bool, tuple[str, ...], list[torch.Tensor]]:
    """Prepare one partition's arguments for ``worker`` (caller side).

    ``attached``: distributed autograd records the call (a context is open, grad mode is on);
    otherwise tensors that require grad travel detached. Returns ``(args, kwargs, needs_decode,
    new_structures, sources)``: the arguments to send, whether the worker must :func:`decode`
    them, the structures sent along, and (not ``attached``) the tensors that travel detached
    but require grad, in the order :func:`decode` makes them leaves. Raises ``TypeError`` for
    a module that cannot be pickled, or a tensor that requires grad hidden in an object.

    Example:
        >>> import torch
        >>> encode((torch.ones(1),), {}, world=None, worker="w", dtype=None, memo=CallMemo())[2]
        False
    """
    if not _needs_encoding(args, dtype, attached) and not _needs_encoding(kwargs, dtype, attached):
        return args, kwargs, False, (), []  # the common fast path: nothing to rewrite
    leaves, spec = tree_flatten((args, kwargs))
    changed = False
    new_structures: list[str] = []
    sources: list[torch.Tensor] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, nn.Module):
            plan, parts = _encode_module(leaf, (args, kwargs, i), dtype, memo, attached)
            if not attached:
                sources.extend(p for _, _, p in plan.param_reads if p.requires_grad)
            structure = None
            if not _is_confirmed(world, worker, plan.fingerprint):
                structure = plan.structure
                new_structures.append(plan.fingerprint)
            leaves[i] = _ModuleRef(plan.fingerprint, structure, *parts)
            changed = True
        elif isinstance(leaf, torch.Tensor):
            if leaf.requires_grad and not attached:
                leaves[i] = _GradLeaf(_wire(leaf.detach(), dtype))
                sources.append(leaf)
                changed = True
            elif isinstance(leaf, nn.Parameter):
                wire = memo.tensors.get(id(leaf))
                if wire is None:
                    # A plain-tensor view is what distributed autograd links to the parameter.
                    t = leaf.view_as(leaf) if leaf.requires_grad else leaf.detach()
                    wire = memo.tensors[id(leaf)] = _wire(t, dtype)
                leaves[i] = wire
                changed = True
            elif isinstance(wire := _wire(leaf, dtype), _Compressed):
                leaves[i] = wire
                changed = True
        elif not _is_plain(leaf):
            _refuse_hidden_grad(leaf, (args, kwargs, i))
    if not changed:
        return args, kwargs, False, (), sources
    new_args, new_kwargs = tree_unflatten(leaves, spec)
    return new_args, new_kwargs, True, tuple(new_structures), sources


def check_sendable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise the error :func:`encode` would raise, for a partition that runs in-process.

    A partition the caller runs itself is never encoded, but the same program on more workers
    would send it: failing here too keeps ``python script.py`` and ``torchrun`` alike.
    """
    if not _needs_encoding(args, None, True) and not _needs_encoding(kwargs, None, True):
        return
    leaves, _ = tree_flatten((args, kwargs))
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, nn.Module):
            _plan_for(leaf, (args, kwargs, i))
        elif not isinstance(leaf, torch.Tensor) and not _is_plain(leaf):
            _refuse_hidden_grad(leaf, (args, kwargs, i))


# --------------------------------------------------------------------------------------------------
# Worker side: cached structures and per-call module rebuilding


class _Rebuilder:
    """What a worker needs to build a fresh module per call from a cached structure."""

    __slots__ = ("bases", "classes", "specs")

    def __init__(self, skeleton: nn.Module, specs: tuple[_Spec, ...]) -> None:
        modules = list(skeleton.modules())
        skip = {"_parameters", "_buffers", "_modules", "training"}
        self.classes = tuple(type(m) for m in modules)
        self.bases = tuple({k: v for k, v in m.__dict__.items() if k not in skip} for m in modules)
        self.specs = specs

    def build(
        self,
        params: list[torch.Tensor],
        buffers: list[torch.Tensor | None],
        training: int,
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
                # RNNs keep a list of their weights (``_flat_weights``) that is filled when the
                # module is made or its parameters are set; refresh it from this call's tensors.
                module._init_flat_weights()
        return fresh[0]


_STRUCTURES: OrderedDict[str, _Rebuilder] = OrderedDict()
_STRUCTURES_LOCK = threading.Lock()


def _rebuilder(fingerprint: str, structure: bytes | None) -> _Rebuilder:
    with _STRUCTURES_LOCK:
        rebuilder = _STRUCTURES.get(fingerprint)
        if rebuilder is not None:
            _STRUCTURES.move_to_end(fingerprint)
            return rebuilder
    if structure is None:
        raise RuntimeError(
            f"module structure {fingerprint} is not cached on this worker (it keeps the "
            f"{STRUCTURE_CACHE_SIZE} most recently used structures); call "
            f"metadist.transport.clear_module_cache() on the caller to resend structures"
        )
    skeleton, specs = pickle.loads(structure)
    rebuilder = _Rebuilder(skeleton, specs)
    with _STRUCTURES_LOCK:
        _STRUCTURES[fingerprint] = rebuilder
        while len(_STRUCTURES) > STRUCTURE_CACHE_SIZE:
            _STRUCTURES.popitem(last=False)
    return rebuilder


def _unwire(item: Any) -> Any:
    """Undo :func:`_wire` (anything else passes through)."""
    return item.tensor.to(item.dtype) if isinstance(item, _Compressed) else item


def _unpack(packed: _Packed, requires_grad: int) -> list[torch.Tensor]:
    flat = _unwire(packed.flat)
    pieces = flat.split([shape.numel() for shape in packed.shapes])
    return [
        piece.view(shape) if requires_grad >> i & 1 else piece.detach().view(shape)
        for i, (piece, shape) in enumerate(zip(pieces, packed.shapes, strict=True))
    ]


def _decode_module(ref: _ModuleRef, leaves: list[torch.Tensor] | None) -> nn.Module:
    rebuilder = _rebuilder(ref.fingerprint, ref.structure)
    if isinstance(ref.params, _Packed):
        params = _unpack(ref.params, ref.requires_grad)
    else:
        params = [_unwire(t) for t in ref.params]
    if leaves is not None:
        # Sent detached: the worker's module holds nn.Parameter leaves, as the caller's does,
        # and the worker differentiates with respect to them when asked (metadist.worker).
        params = [
            nn.Parameter(t, requires_grad=bool(ref.requires_grad >> i & 1))
            for i, t in enumerate(params)
        ]
        leaves.extend(p for p in params if p.requires_grad)
    return rebuilder.build(params, [_unwire(b) for b in ref.buffers], ref.training)


def decode(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, leaves: bool = False
) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]:
    """Rebuild modules and decompress tensors of arguments made by :func:`encode` (worker side).

    With ``leaves`` (the call travelled detached), module parameters become ``nn.Parameter``
    leaves; returns ``(args, kwargs, leaves)`` with the leaves that require grad in the order of
    :func:`encode`'s ``sources``. Raises ``RuntimeError`` for a structure neither sent nor cached.

    Example:
        >>> decode((1,), {"a": 2})
        ((1,), {'a': 2}, [])
    """
    flat, spec = tree_flatten((args, kwargs))
    made: list[torch.Tensor] | None = [] if leaves else None
    for i, leaf in enumerate(flat):
        if isinstance(leaf, _ModuleRef):
            flat[i] = _decode_module(leaf, made)
        elif isinstance(leaf, _Compressed):
            flat[i] = _unwire(leaf)
        elif isinstance(leaf, _GradLeaf):
            t = _unwire(leaf.tensor)
            flat[i] = t.requires_grad_(True) if t.is_leaf else t.detach().requires_grad_(True)
            if made is not None:
                made.append(flat[i])
    new_args, new_kwargs = tree_unflatten(flat, spec)
    return new_args, new_kwargs, made or []


def compress_tree(tree: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensor leaves of ``tree`` to ``dtype`` for the wire (differentiably).

    Example:
        >>> import torch
        >>> decompress_tree(compress_tree([torch.ones(2)], torch.bfloat16))[0].dtype
        torch.float32
    """
    leaves, spec = tree_flatten(tree)
    wired = [_wire(t, dtype) if isinstance(t, torch.Tensor) else t for t in leaves]
    return tree_unflatten(wired, spec)


def decompress_tree(tree: Any) -> Any:
    """Undo :func:`compress_tree`."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([_unwire(leaf) for leaf in leaves], spec)


def wire_bytes(tree: Any) -> int:
    """Bytes of the tensor data in ``tree`` (encoded) as it travels, module tensors included."""
    leaves, _ = tree_flatten(tree)
    total = 0
    for leaf in leaves:
        item = leaf
        while isinstance(item, (_Compressed, _GradLeaf)):
            item = item.tensor
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, _ModuleRef):
            params = item.params.flat if isinstance(item.params, _Packed) else item.params
            total += wire_bytes([params, *item.buffers])
    return total
