"""How arguments and results travel: modules by cached structure, leaves, meta, compression.

metadist never pickles a module as is. For each ``nn.Module`` argument it sends its structure
once per worker (:mod:`metadist.structure`) and, on every call, the parameter tensors, the
buffers and the ``training`` flag of every submodule; the worker rebuilds a fresh module object
per call (a module argument that is a submodule of another arrives as that one's submodule).
Tensors travel detached: :func:`decode` makes the parameters ``nn.Parameter`` leaves
and the tensors that required grad leaf tensors again, listing them in the order of
:func:`encode`'s ``sources``, and the worker differentiates with respect to them
(:mod:`metadist.worker`). Only a call that travels *attached* to a distributed autograd context
(one with an RRef among its arguments) sends them as they are, parameters as aliases that
torch's distributed autograd records (it rebuilds a pickled ``nn.Parameter`` as a new leaf it
never links to the caller's). Buffers always travel detached (remote buffer updates, e.g.
BatchNorm running statistics, are not sent back). Meta tensors travel as what they are, shape and
dtype. With compression (``"bf16"`` or ``"fp16"``), floating-point tensors are cast for the
wire, gradients too, and cast back on arrival.

Tensors that exist only inside a ``torch.func`` transform, and forward-mode dual tensors, cannot
travel: :func:`encode` and :func:`check_sendable` refuse them, naming the argument.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle
import types
from typing import Any

import numpy
import torch
from torch import nn
from torch.autograd import forward_ad
from torch.distributed.rpc import PyRRef  # type: ignore[attr-defined]

from metadist import structure
from metadist._pytree import (
    argument_path,
    flatten_arguments,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)
from metadist.structure import clear_module_cache, invalidate_module_cache

__all__ = [
    "CallMemo",
    "check_sendable",
    "clear_module_cache",
    "decode",
    "encode",
    "invalidate_module_cache",
    "is_plain",
    "refuse_hidden_grad",
    "resolve_compression",
    "snapshot",
    "storageless",
    "unchanged",
    "unwire",
    "unwire_tree",
    "wire",
    "wire_bytes",
]

_COMPRESSION = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def resolve_compression(compression: str | None) -> torch.dtype | None:
    """The wire dtype of a ``compression`` argument (``None``: none); ``ValueError`` otherwise."""
    if compression is None:
        return None
    dtype = _COMPRESSION.get(compression) if isinstance(compression, str) else None
    if dtype is None:
        raise ValueError(f"compression must be None, 'bf16' or 'fp16', got {compression!r}")
    return dtype


# --------------------------------------------------------------------------------------------------
# Wire objects (pickled by RPC; tensors inside go through RPC's tensor channel)


class _Wire:
    """Pickled positionally: smaller and faster to unpickle than a dict of slot names."""

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
class _Meta(_Wire):
    """A meta tensor: no data, only what RPC's tensor channel cannot carry for it."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass(slots=True)
class _Coalesced(_Wire):
    """A coalesced sparse COO tensor: RPC's tensor channel drops the flag, and torch then
    refuses ``indices()`` on the copy."""

    indices: torch.Tensor
    values: Any  # wired
    size: tuple[int, ...]


@dataclasses.dataclass(slots=True)
class _GradLeaf(_Wire):
    """A tensor that requires grad, travelling detached; the worker makes it a leaf that
    requires grad again (also under the caller's ``torch.no_grad()``, for an inner loop that
    differentiates locally inside the remote function, as it would locally), an
    ``nn.Parameter`` if it was one. The function gets what the caller's tensor was
    (``origin``): that leaf, a view of it, or a tensor computed from it (a copy), so that
    in-place changes work, or raise torch's error, as they would on the caller's tensor."""

    tensor: Any
    parameter: bool
    hooked: int  # the caller's tensor's _hook_flags: see _guard
    origin: int  # _LEAF, _LEAF_VIEW or _COMPUTED
    grad: Any  # the caller's leaf's .grad (wired), or None


_LEAF, _LEAF_VIEW, _COMPUTED = 0, 1, 2


# Hooks of a caller's tensor that a worker's copy cannot run (bits; see _guard): tensor hooks
# (register_hook), and post-accumulate-grad hooks (register_post_accumulate_grad_hook).
_TENSOR_HOOKS, _ACCUMULATE_HOOKS = 1, 2


def _hook_flags(t: torch.Tensor) -> int:
    flags = _TENSOR_HOOKS if t._backward_hooks else 0
    if t._post_accumulate_grad_hooks:
        flags |= _ACCUMULATE_HOOKS
    return flags


def _origin(t: torch.Tensor) -> int:
    if t.is_leaf:
        return _LEAF
    return _LEAF_VIEW if t._base is not None and t._base.is_leaf else _COMPUTED


@dataclasses.dataclass(slots=True)
class _Parameter(_Wire):
    """An ``nn.Parameter`` that does not require grad: one again on the worker (a function may
    assign it to a module, which takes nothing else)."""

    tensor: Any


@dataclasses.dataclass(slots=True)
class _ModuleRef(_Wire):
    """A module on the wire: structure fingerprint (+ bytes if not cached yet) and its tensors."""

    fingerprint: str
    structure: bytes | None
    params: tuple[Any, ...]
    buffers: tuple[Any, ...]
    training: int
    requires_grad: int
    hooked: int  # each parameter's _hook_flags on the caller, two bits each: see _guard
    grads: tuple[Any, ...]  # each parameter's .grad (wired, or None); () when none has one


@dataclasses.dataclass(slots=True)
class _SubmoduleRef(_Wire):
    """A module argument that is a submodule of another module argument of the partition: it
    arrives as that very submodule of the rebuilt module (``m[1] is bn`` holds, and a change of
    its state is seen by ``m``'s forward), as in one process. Its tensors travel with ``m``."""

    root: int  # where the enclosing module argument sits among the flattened arguments
    index: int  # the submodule's index in that module's modules()


def wire(tensor: torch.Tensor, dtype: torch.dtype | None) -> Any:
    """``tensor`` as it travels: a meta tensor's description, or cast to the wire ``dtype``."""
    if tensor.is_meta:
        return _Meta(tuple(tensor.shape), tensor.stride(), tensor.dtype)
    if tensor.is_sparse and tensor.is_coalesced():
        return _Coalesced(tensor.indices(), wire(tensor.values(), dtype), tuple(tensor.shape))
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return _Compressed(tensor.to(dtype), tensor.dtype)
    return tensor


def unchanged(now: torch.Tensor, before: torch.Tensor) -> bool:
    """Whether tensor ``now`` holds what its copy ``before`` held: its shape and values (for a
    meta tensor, which has none, its shape)."""
    if now.layout != before.layout or now.shape != before.shape or now.dtype != before.dtype:
        return False
    if now.is_meta:
        return True
    if now.is_sparse:
        now, before = now.coalesce(), before.coalesce()
        return torch.equal(now.indices(), before.indices()) and _same_values(
            now.values(), before.values()
        )
    return _same_values(now.to_dense(), before.to_dense())


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, with NaN equal to NaN (a ``.grad`` that overflowed stays unchanged)."""
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)


def unwire(item: Any) -> Any:
    """Undo :func:`wire` (anything else passes through)."""
    if isinstance(item, _Compressed):
        return item.tensor.to(item.dtype)
    if isinstance(item, _Meta):
        return torch.empty_strided(item.size, item.stride, dtype=item.dtype, device="meta")
    if isinstance(item, _Coalesced):
        return torch.sparse_coo_tensor(
            item.indices,
            unwire(item.values),
            item.size,
            is_coalesced=True,
            check_invariants=False,  # the sender's tensor was coalesced, so valid
        )
    return item


# --------------------------------------------------------------------------------------------------
# Caller side


def storageless(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dense tensor without storage: a torch.func or vmap wrapper, which
    exists only inside its transform (RPC aborts the process on one)."""
    if t.layout != torch.strided:
        return False  # sparse tensors have no single storage either, and travel
    try:
        t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return True
    return False


def _why_not(t: torch.Tensor) -> str | None:
    """Why tensor ``t`` cannot travel, or ``None``."""
    if storageless(t):
        return (
            "is a tensor of a torch.func transform (grad, vjp, jvp, vmap, jacrev, "
            "functional_call under one of them, ...), which exists only inside the transform. "
            "Call the remote function outside the transform: remote calls are differentiable "
            "with torch.autograd.grad or backward() instead"
        )
    if forward_ad._current_level >= 0 and forward_ad.unpack_dual(t).tangent is not None:
        return (
            "is a dual tensor of forward-mode AD (torch.autograd.forward_ad), whose tangent "
            "a remote call cannot carry. Differentiate the call in reverse mode "
            "(torch.autograd.grad or backward()), or pass the primal (unpack_dual(t).primal)"
        )
    return None


@dataclasses.dataclass(slots=True)
class CallMemo:
    """Per-call memo so that a module or tensor used by several partitions, or twice in one,
    is encoded once: one object in a message arrives as one object (pickle keeps identity)."""

    modules: dict[int, tuple[structure.SendPlan, tuple[Any, ...]]] = dataclasses.field(
        default_factory=dict
    )
    tensors: dict[int, Any] = dataclasses.field(default_factory=dict)


# Where a leaf sits in the arguments: (args, kwargs, leaf index); named only on errors.
_Where = tuple[tuple[Any, ...], dict[str, Any], int]


def _name(where: _Where) -> str:
    pairs, _ = tree_flatten_with_path((where[0], where[1]))
    return argument_path(pairs[where[2]][0])


def _refuse(t: torch.Tensor, where: _Where, what: str = "argument") -> None:
    why = _why_not(t)
    if why is not None:
        raise TypeError(f"{what} {_name(where)} {why}")


def _encode_module(
    module: nn.Module, where: _Where, dtype: torch.dtype | None, memo: CallMemo, attached: bool
) -> Any:
    cached = memo.modules.get(id(module))
    if cached is not None:
        return cached
    plan, modules = structure.plan_for(module, functools.partial(_name, where))
    if _transforming():
        for _, name, p in plan.param_reads:
            _refuse(p, where, f"parameter {name!r} of module argument")
    requires_grad = sum(1 << i for i, (_, _, p) in enumerate(plan.param_reads) if p.requires_grad)
    hooked = sum(
        _hook_flags(p) << 2 * i
        for i, (_, _, p) in enumerate(plan.param_reads)
        if p._backward_hooks or p._post_accumulate_grad_hooks  # rare: no call for the others
    )
    params = [_sent_tensor(p, dtype, memo, attached) for _, _, p in plan.param_reads]
    buffers = tuple(
        None if (b := modules[k]._buffers.get(name)) is None else wire(b.detach(), dtype)
        for k, name in plan.buffer_reads
    )
    training = sum(1 << i for i, m in enumerate(modules) if m.training)
    grads: tuple[Any, ...] = ()
    if not attached and any(p.grad is not None for _, _, p in plan.param_reads):
        grads = tuple(_grad_of(p) for _, _, p in plan.param_reads)
    sent = (tuple(params), buffers, training, requires_grad, hooked, grads)
    memo.modules[id(module)] = (plan, sent)
    return plan, sent


def _sent_tensor(t: torch.Tensor, dtype: torch.dtype | None, memo: CallMemo, attached: bool) -> Any:
    """What travels for tensor ``t``, made once per call: a parameter of a module argument
    passed as an argument of its own too arrives as the same tensor on the worker."""
    sent = memo.tensors.get(id(t))
    if sent is None:
        # Attached, a non-leaf alias is what distributed autograd links to the tensor.
        alias = attached and t.requires_grad
        sent = wire(torch.ops.aten.alias.default(t) if alias else t.detach(), dtype)
        memo.tensors[id(t)] = sent
    return sent


def _grad_of(t: torch.Tensor) -> Any:
    """A leaf's ``.grad`` as it travels, so that the function sees it as in one process (and a
    ``zero_grad()`` there clears it); ``None`` for a leaf without one or a non-leaf."""
    if not t.is_leaf or t.grad is None:
        return None
    return wire(t.grad.detach(), None)


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


def _transforming() -> bool:
    """Whether a torch.func transform or a forward-mode AD level is active on this thread, the
    only places where tensors that cannot travel exist (torch has no public way to ask; this
    keeps the per-tensor checks off every other call)."""
    return torch._C._functorch.maybe_current_level() is not None or forward_ad._current_level >= 0


def _needs_encoding(obj: Any, dtype: torch.dtype | None, attached: bool) -> bool:
    """Whether ``obj`` holds a module, a parameter, a tensor that requires grad but travels
    detached, a tensor RPC cannot carry as it is, (with compression) a float tensor, or an
    object pytree cannot look into.

    A quick scan of plain containers; any other object answers True so that the full pytree
    walk decides.
    """
    if isinstance(obj, torch.Tensor):
        if isinstance(obj, nn.Parameter) or (obj.requires_grad and not attached):
            return True
        if obj.is_meta or obj.is_sparse:
            return True
        if _transforming() and _why_not(obj) is not None:
            return True
        return dtype is not None and obj.is_floating_point() and obj.dtype != dtype
    kind = type(obj)
    # Explicit loops: this runs on every call and is faster than any() over a generator.
    if kind is tuple or kind is list or kind is dict:
        for item in obj.values() if kind is dict else obj:
            if _needs_encoding(item, dtype, attached):
                return True
        return False
    if isinstance(obj, nn.Module):
        return True
    return not is_plain(obj)


def is_plain(obj: Any) -> bool:
    """Whether ``obj`` is a leaf that cannot hold a tensor."""
    if isinstance(obj, _PLAIN_LEAVES):
        return True
    return isinstance(obj, numpy.ndarray) and obj.dtype != object


def refuse_hidden_grad(obj: Any, name: str) -> None:
    """Raise ``TypeError`` if ``obj`` (named ``name``), a leaf pytree cannot look into, cannot be
    pickled or holds a tensor that requires grad (RPC would send it detached, its gradient lost
    without a word). The scan pickles ``obj`` with every tensor replaced by a reference, so no
    tensor data is copied."""
    finder = _TensorFinder(io.BytesIO())
    try:
        finder.dump(obj)
    except Exception as error:  # RPC would fail to send it: say so here, in-process too
        raise TypeError(
            f"{name} ({type(obj).__qualname__}) cannot be sent to other workers: pickling it "
            f"failed with {type(error).__name__}: {error}"
            + (" (pass list(...) of it instead)" if isinstance(obj, types.GeneratorType) else "")
        ) from error
    if finder.found:
        raise TypeError(
            f"{name} ({type(obj).__qualname__}) holds a tensor that "
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
        if isinstance(obj, PyRRef):  # RPC's pickler sends it; plain pickle cannot
            return id(obj)
        return None


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

    ``attached``: distributed autograd records the call; otherwise tensors that require grad
    travel detached. Returns ``(args, kwargs, needs_decode, new_structures, sources)``: the
    arguments to send, whether the worker must :func:`decode` them, the structures sent along,
    and (not ``attached``) the tensors that travel detached but require grad, in the order
    :func:`decode` makes them leaves. Raises ``TypeError`` for a module that cannot be pickled,
    a tensor that requires grad hidden in an object, or a tensor that cannot travel.
    """
    if not _needs_encoding(args, dtype, attached) and not _needs_encoding(kwargs, dtype, attached):
        return args, kwargs, False, (), []  # the common fast path: nothing to rewrite
    leaves, rebuild = flatten_arguments(args, kwargs)
    transforming = _transforming()  # only there are tensors that cannot travel
    new_structures: list[str] = []
    # Each source once, in the order decode makes its leaf: an object in two places of the
    # arguments (f(x, x), a model and its own parameters) is one object on the worker too.
    sources: dict[int, torch.Tensor] = {}
    # This message's encoding of each module and tensor; first, of the module arguments that
    # travel inside another (their tensors are that one's, sources with it).
    refs: dict[int, Any] = _submodule_refs(leaves)
    for i, leaf in enumerate(leaves):
        ref = refs.get(id(leaf))
        if ref is not None:
            leaves[i] = ref
        elif isinstance(leaf, nn.Module):
            plan, sent = _encode_module(leaf, (args, kwargs, i), dtype, memo, attached)
            if not attached:
                for _, _, p in plan.param_reads:
                    if p.requires_grad:
                        sources.setdefault(id(p), p)
            bytes_ = None
            if not structure.is_confirmed(world, worker, plan.fingerprint):
                bytes_ = plan.structure
                new_structures.append(plan.fingerprint)
            leaves[i] = refs[id(leaf)] = _ModuleRef(plan.fingerprint, bytes_, *sent)
        elif isinstance(leaf, torch.Tensor):
            if transforming:
                _refuse(leaf, (args, kwargs, i))
            if leaf.requires_grad and not attached:
                parameter = isinstance(leaf, nn.Parameter)
                sent = _sent_tensor(leaf, dtype, memo, attached)
                hooked = _hook_flags(leaf)
                grad_leaf = _GradLeaf(sent, parameter, hooked, _origin(leaf), _grad_of(leaf))
                leaves[i] = refs[id(leaf)] = grad_leaf
                sources.setdefault(id(leaf), leaf)
            elif isinstance(leaf, nn.Parameter):
                sent = _sent_tensor(leaf, dtype, memo, attached)
                leaves[i] = refs[id(leaf)] = sent if leaf.requires_grad else _Parameter(sent)
            else:
                leaves[i] = refs[id(leaf)] = wire(leaf, dtype)
        elif not is_plain(leaf):
            refuse_hidden_grad(leaf, f"argument {_name((args, kwargs, i))}")
    new_args, new_kwargs = rebuild(leaves)
    return new_args, new_kwargs, True, tuple(new_structures), list(sources.values())


def snapshot(tree: Any, copies: dict[Any, Any]) -> Any:
    """``tree`` (encoded arguments) with copies of its tensors: an asynchronous call returns
    before RPC has read them, and the caller may change them in place meanwhile. ``copies``,
    shared by a call's partitions, keeps identity and memory sharing: one copy per tensor, wire
    object and storage (views of one tensor stay views of one copy, as RPC sends them)."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([_copy(leaf, copies) for leaf in leaves], spec)


def _copy(obj: Any, copies: dict[Any, Any]) -> Any:
    if not isinstance(obj, (torch.Tensor, _Wire)):
        return obj
    copied = copies.get(id(obj))
    if copied is None:
        if isinstance(obj, torch.Tensor):
            copied = _copy_tensor(obj, copies)
        else:
            names: tuple[str, ...] = obj.__slots__  # the fields, in order (see _Wire)
            copied = type(obj)(*(snapshot(getattr(obj, name), copies) for name in names))
        copies[id(obj)] = copied
    return copied


def _copy_tensor(t: torch.Tensor, copies: dict[Any, Any]) -> torch.Tensor:
    if t.layout != torch.strided:
        return t.clone()  # sparse: no storage of its own to share
    storage = t.untyped_storage()
    key = ("storage", storage.device, storage.data_ptr())
    copied = copies.get(key)
    if copied is None:
        copied = copies[key] = storage.clone()
    with torch.no_grad():
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            copied, t.storage_offset(), t.size(), t.stride()
        )


def _submodule_refs(leaves: list[Any]) -> dict[int, Any]:
    """A :class:`_SubmoduleRef` for each module argument (by id) inside another module argument,
    pointing into an outermost one (one inside no other); modules inside each other both ways (a
    cycle) travel apart. A submodule's plan is never made: it travels with its module (so a
    back-reference to that module in its attributes is no unregistered module of its own)."""
    first: dict[int, int] = {}  # each module argument's first position among the leaves
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, nn.Module):
            first.setdefault(id(leaf), i)
    if len(first) < 2:
        return {}
    # {module argument: {position of a module argument holding it: its index there}}
    holders: dict[int, dict[int, int]] = {}
    for i in first.values():
        # modules() in the order of the module's plan (structure.SendPlan lists it so).
        for k, module in enumerate(leaves[i].modules()):
            if k and id(module) in first:
                holders.setdefault(id(module), {})[i] = k
    refs: dict[int, Any] = {}
    for key, held_by in holders.items():
        for i, k in held_by.items():
            if id(leaves[i]) not in holders:
                refs[key] = _SubmoduleRef(i, k)
                break
    return refs


def check_sendable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise the error :func:`encode` would raise, for a partition that runs in-process.

    A partition the caller runs itself is never encoded, but the same program on more workers
    would send it: failing here too keeps ``python script.py`` and ``torchrun`` alike.
    """
    if not _needs_encoding(args, None, True) and not _needs_encoding(kwargs, None, True):
        return
    leaves, _ = flatten_arguments(args, kwargs)
    transforming = _transforming()  # only there are tensors that cannot travel
    nested = _submodule_refs(leaves)  # these travel inside another module argument
    for i, leaf in enumerate(leaves):
        where = (args, kwargs, i)
        if isinstance(leaf, nn.Module):
            if id(leaf) not in nested:
                structure.plan_for(leaf, functools.partial(_name, where))
            if transforming:
                for name, p in leaf.named_parameters():
                    _refuse(p, where, f"parameter {name!r} of module argument")
        elif isinstance(leaf, torch.Tensor):
            if transforming:
                _refuse(leaf, where)
        elif not is_plain(leaf):
            refuse_hidden_grad(leaf, f"argument {_name(where)}")


# --------------------------------------------------------------------------------------------------
# Worker side


def _hooks_skipped(what: str, _: torch.Tensor) -> None:
    """Stands in on a worker, while the function runs, for the tensor hooks of the caller's
    tensor (functions only the caller can run): a gradient the function computes inside
    reaches it, and would skip them. Taken off when the function returns (``guards``): the
    worker's later passes answer the caller, whose hooks see the answers."""
    raise RuntimeError(
        f"a gradient computed inside this remote partition reaches {what}, whose tensor on "
        f"the caller has tensor hooks (register_hook, gradient clipping by hooks say): in one "
        f"process they would change this gradient, and they cannot run here. Run the partition "
        f"on the caller (partitioner=0), or apply the hook's change inside the function"
    )


def _accumulation_skipped(what: str, _: torch.Tensor) -> None:
    """Stands in on a worker, while the function runs, for the post-accumulate-grad hooks of
    the caller's tensor: a backward pass inside accumulates into it, after which they would run
    (an optimizer step in backward, changing the tensor in the middle of the function). Only an
    accumulation: ``torch.autograd.grad`` runs no such hook in one process either."""
    raise RuntimeError(
        f"a backward pass inside this remote partition accumulates a gradient into {what}, "
        f"whose tensor on the caller has post-accumulate-grad hooks "
        f"(register_post_accumulate_grad_hook, an optimizer step in backward say): in one "
        f"process they would run after this accumulation, and they cannot run here. Run the "
        f"partition on the caller (partitioner=0), or do the hook's work inside the function "
        f"after its backward"
    )


def _guard(t: torch.Tensor, flags: int, what: str, guards: list[Any]) -> None:
    """Stand-ins on the worker's leaf ``t`` for the hooks the caller's tensor has (``flags``,
    see :func:`_hook_flags`); their handles join ``guards``."""
    if flags & _TENSOR_HOOKS:
        guards.append(t.register_hook(functools.partial(_hooks_skipped, what)))
    if flags & _ACCUMULATE_HOOKS:
        stand_in = functools.partial(_accumulation_skipped, what)
        guards.append(t.register_post_accumulate_grad_hook(stand_in))


def _decode_module(
    ref: _ModuleRef,
    position: int,
    leaves: list[torch.Tensor] | None,
    guards: list[Any],
    made: dict[int, Any],
) -> nn.Module:
    params = []
    hooked: list[tuple[nn.Parameter, int]] = []  # parameters to guard once they have names
    for i, sent in enumerate(ref.params):
        p = made.get(id(sent))
        if p is None:
            p = unwire(sent)
            if leaves is not None:
                p = nn.Parameter(p, requires_grad=bool(ref.requires_grad >> i & 1))
                if ref.grads and ref.grads[i] is not None:
                    p.grad = unwire(ref.grads[i])
                flags = ref.hooked >> 2 * i & 3
                if p.requires_grad:
                    leaves.append(p)
                    if flags:
                        hooked.append((p, flags))
            made[id(sent)] = p
        params.append(p)
    rebuilder = structure.rebuilder(ref.fingerprint, ref.structure)
    module = rebuilder.build(params, [unwire(b) for b in ref.buffers], ref.training)
    if hooked:
        names = {id(p): name for name, p in module.named_parameters()}
        for p, flags in hooked:
            what = f"parameter {names[id(p)]!r} of module argument {position} (flattened)"
            _guard(p, flags, what, guards)
    return module


def _decode_tensor(leaf: Any, i: int, leaves: list[torch.Tensor] | None, guards: list[Any]) -> Any:
    if isinstance(leaf, _GradLeaf):
        t = unwire(leaf.tensor)
        if leaf.parameter:
            t = nn.Parameter(t)
        else:
            t = t.requires_grad_(True) if t.is_leaf else t.detach().requires_grad_(True)
        if leaf.grad is not None:
            t.grad = unwire(leaf.grad)
        _guard(t, leaf.hooked, f"argument {i} (flattened)", guards)
        if leaves is not None:
            leaves.append(t)
        if leaf.origin != _LEAF:
            with torch.enable_grad():
                # Not a view for a computed tensor: torch refuses in-place changes of a leaf's
                # views, and allows them on a computed tensor.
                return t.view_as(t) if leaf.origin == _LEAF_VIEW else t.clone()
        return t
    if isinstance(leaf, _Parameter):
        return nn.Parameter(unwire(leaf.tensor), requires_grad=False)
    return unwire(leaf)


def decode(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, leaves: bool = False
) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor], list[Any]]:
    """Rebuild modules and tensors of arguments made by :func:`encode` (worker side).

    With ``leaves`` (the call travelled detached), module parameters become ``nn.Parameter``
    leaves; returns ``(args, kwargs, leaves, guards)`` with the leaves that require grad in the
    order of :func:`encode`'s ``sources``, and the handles of the stand-ins for the caller's
    tensor hooks (see :func:`_guard`), to remove once the function returned. Raises
    ``RuntimeError`` for a structure neither sent nor cached.
    """
    flat, rebuild = flatten_arguments(args, kwargs)
    grad_leaves: list[torch.Tensor] | None = [] if leaves else None
    guards: list[Any] = []
    # Decoded once per object sent: what was one object on the caller is one here (the message
    # holds one object for it, see encode), a module parameter passed beside its module too.
    made: dict[int, Any] = {}
    nested: list[int] = []  # where a _SubmoduleRef sits: resolved once its module is rebuilt
    for i, leaf in enumerate(flat):
        key = id(leaf.tensor) if isinstance(leaf, (_GradLeaf, _Parameter)) else id(leaf)
        done = made.get(key)
        if done is not None:
            flat[i] = done
        elif isinstance(leaf, _SubmoduleRef):
            nested.append(i)
        elif isinstance(leaf, _ModuleRef):
            flat[i] = made[key] = _decode_module(leaf, i, grad_leaves, guards, made)
        elif isinstance(leaf, (torch.Tensor, _Wire)):
            flat[i] = made[key] = _decode_tensor(leaf, i, grad_leaves, guards)
    for i in nested:
        # The rebuilt module's modules() come in the caller's order (the plan's), shared
        # submodules once, as the rebuilder makes them from that list.
        flat[i] = list(flat[flat[i].root].modules())[flat[i].index]
    new_args, new_kwargs = rebuild(flat)
    return new_args, new_kwargs, grad_leaves or [], guards


def unwire_tree(tree: Any) -> Any:
    """Undo :func:`wire` on every leaf of ``tree``."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([unwire(leaf) for leaf in leaves], spec)


def wire_bytes(tree: Any) -> int:
    """Bytes of the tensor data in ``tree`` (encoded) as it travels, module tensors included."""
    leaves, _ = tree_flatten(tree)
    total = 0
    for leaf in leaves:
        item = leaf
        while isinstance(item, (_Compressed, _GradLeaf, _Parameter)):
            item = item.tensor
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, _Coalesced):
            total += wire_bytes([item.indices, item.values])
        elif isinstance(item, _ModuleRef):
            total += wire_bytes([item.params, item.buffers])
    return total
