"""Mappings that carry tensors from one streamed layer to later ones, through autograd.

Some decoder layers take a mutable mapping that earlier layers fill and later ones read (Gemma
4's layers that reuse an earlier layer's keys and values: a ``UserDict`` the model's forward
hands every layer). A streamed layer runs inside an autograd ``Function`` on detached leaves:
handed the mapping as it is, the tensors a layer reads from it would be no input of that
Function (no gradient would reach the layer that made them) and those it writes would belong to
a graph nobody differentiates. So a streamed layer's call carries each such mapping: its
tensors become Function inputs, the layer runs on a fresh copy of the mapping filled with their
leaves, and what the layer writes into that copy comes back as Function outputs, which the
caller's mapping then holds (``CarriedMapping``).

A plain ``dict`` argument never needs this: pytree flattens it, so its tensors are Function
inputs already (and a layer writing into it would write into a copy: no family does).
"""

from __future__ import annotations

import copy
from collections.abc import MutableMapping
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class CarriedKey(NamedTuple):
    """Names one tensor a layer wrote into a carried mapping: the mapping's place among the
    call's carried mappings, the key, and the tensor's place in the key's flattened value."""

    mapping: int
    key: Any
    leaf: int


class _Entry(NamedTuple):
    key: Any
    leaves: list  # the value's pytree leaves, None where a tensor goes
    spec: Any
    n_tensors: int


def _entry(key: Any, value: Any) -> tuple[_Entry, list[torch.Tensor]]:
    """``value``'s layout (its pytree leaves, None where a tensor goes) and its tensors."""
    leaves, spec = tree_flatten(value)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    holes = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    return _Entry(key, holes, spec, len(tensors)), tensors


class CarriedMapping:
    """Stands in a streamed layer's flattened arguments for one mapping the layer may read and
    write; its tensors follow the arguments the call flattened (from ``start`` on).

    ``bind`` builds the mapping the layer runs on from those tensors; ``written`` lists what the
    layer put into it; ``write_back`` puts the Function's outputs for those into the caller's.
    """

    def __init__(self, original: MutableMapping, entries: list[_Entry], start: int) -> None:
        self.original = original
        # An empty copy of the caller's mapping type (its class and any attributes), filled anew
        # for each run of the layer.
        self._template = copy.copy(original)
        self._template.clear()
        self._entries = entries
        self.start = start
        self.n_tensors = sum(e.n_tensors for e in entries)
        # What the last run wrote (value leaves with None for tensors) and the keys it removed;
        # set by ``written`` (the forward's run; reruns write the same).
        self.writes: list[_Entry] = []
        self.removed: list[Any] = []

    @classmethod
    def of(cls, original: MutableMapping, start: int) -> tuple[CarriedMapping, list[torch.Tensor]]:
        """The stand-in for ``original``, whose tensors will sit from ``start`` on, and those
        tensors (in order)."""
        entries, tensors = [], []
        for key, value in original.items():
            entry, found = _entry(key, value)
            entries.append(entry)
            tensors += found
        return cls(original, entries, start), tensors

    def bind(self, tensors: list) -> MutableMapping:
        """The mapping the layer runs on: the caller's entries, their tensors ``tensors`` (the
        Function's leaves for them, in ``self.tensors``' order)."""
        fresh = copy.copy(self._template)
        it = iter(tensors)
        for e in self._entries:
            leaves = [next(it) if x is None else x for x in e.leaves]
            fresh[e.key] = tree_unflatten(leaves, e.spec)
        return fresh

    def written(self, fresh: MutableMapping, index: int, bound: list) -> list[tuple]:
        """``(CarriedKey, tensor)`` for every tensor of an entry the layer added or replaced in
        ``fresh`` (``bound``: the tensors it was bound with); records the writes."""
        before = {}
        it = iter(bound)
        for e in self._entries:
            before[e.key] = [next(it) for _ in range(e.n_tensors)]
        out, writes = [], []
        for key, value in fresh.items():
            entry, tensors = _entry(key, value)
            old = before.get(key)
            if (
                old is not None
                and len(old) == len(tensors)
                and all(a is b for a, b in zip(old, tensors))
            ):
                continue  # read, not written
            writes.append(entry)
            out += [(CarriedKey(index, key, k), t) for k, t in enumerate(tensors)]
        self.writes = writes
        self.removed = [k for k in before if k not in fresh]
        return out

    def write_back(self, tensors: list[torch.Tensor]) -> None:
        """Put the recorded writes into the caller's mapping, their tensors ``tensors`` (the
        Function's outputs for them, in order)."""
        it = iter(tensors)
        for e in self.writes:
            leaves = [next(it) if x is None else x for x in e.leaves]
            self.original[e.key] = tree_unflatten(leaves, e.spec)
        for key in self.removed:
            self.original.pop(key, None)


def carry_mappings(flat_args: list) -> tuple[list, list[CarriedMapping]]:
    """``flat_args`` (a call's flattened arguments) with every mutable mapping among them
    replaced by a ``CarriedMapping`` and the mappings' tensors appended after them."""
    flat_args = list(flat_args)
    carried: list[CarriedMapping] = []
    extra: list[torch.Tensor] = []
    n = len(flat_args)
    for pos, x in enumerate(flat_args[:n]):
        if isinstance(x, MutableMapping) and not isinstance(x, dict):
            c, tensors = CarriedMapping.of(x, n + len(extra))
            extra += tensors
            flat_args[pos] = c
            carried.append(c)
    return flat_args + extra, carried


def bind_mappings(flat_args: list, n_leaves: int) -> tuple[list, list[tuple]]:
    """The call's own ``n_leaves`` flattened arguments, each ``CarriedMapping`` replaced by the
    mapping to run on (its tensors from the appended ones); and ``(index, carried, mapping,
    bound tensors)`` per carried mapping, for ``collect_writes``."""
    base = list(flat_args[:n_leaves])
    bound = []
    for pos, x in enumerate(base):
        if isinstance(x, CarriedMapping):
            tensors = list(flat_args[x.start : x.start + x.n_tensors])
            fresh = x.bind(tensors)
            base[pos] = fresh
            bound.append((len(bound), x, fresh, tensors))
    return base, bound


def collect_writes(bound: list[tuple]) -> list[tuple]:
    """``(CarriedKey, tensor)`` for what the layer wrote into each bound mapping."""
    out = []
    for index, carried, fresh, tensors in bound:
        out += carried.written(fresh, index, tensors)
    return out


def write_back(carried: list[CarriedMapping], keys: list, tensors: list[torch.Tensor]) -> None:
    """Hand each carried mapping the outputs named by ``CarriedKey`` keys among ``keys``."""
    per_mapping: list[list[torch.Tensor]] = [[] for _ in carried]
    for key, t in zip(keys, tensors):
        per_mapping[key.mapping].append(t)
    for c, ts in zip(carried, per_mapping):
        c.write_back(ts)
