"""Mappings carried through a streamed layer's autograd Function (core/carried.py), on their
own: what a layer reads is left alone, what it adds, replaces or removes reaches the caller's
mapping. (Through real layers: tests/test_gemma4.py, Gemma's shared keys and values.)"""

from __future__ import annotations

from collections import UserDict

import torch

from hf_megatrain.core.carried import (
    CarriedKey,
    CarriedMapping,
    bind_mappings,
    carry_mappings,
    collect_writes,
    write_back,
)


def test_reads_are_left_alone_and_writes_reach_the_callers_mapping():
    k, v, w = torch.ones(2), torch.zeros(2), torch.full((3,), 2.0)
    caller = UserDict({"full": (k, v), "sliding": (w, "tag")})
    x = torch.randn(4)
    flat, carried = carry_mappings([x, caller, 5])
    # The mapping's place holds its stand-in; its tensors follow the call's own arguments.
    assert isinstance(flat[1], CarriedMapping) and carried == [flat[1]]
    assert [t is s for t, s in zip(flat[3:], (k, v, w))] == [True] * 3 and len(flat) == 6
    # The layer runs on a fresh mapping of the caller's type, bound to the tensors it is given
    # (the Function's leaves for them).
    leaves = [t.detach().requires_grad_() for t in flat[3:]]
    args, bound = bind_mappings(flat[:3] + leaves, 3)
    fresh = args[1]
    assert type(fresh) is UserDict and fresh is not caller and args[0] is x and args[2] == 5
    assert fresh["full"][0] is leaves[0] and fresh["sliding"] == (leaves[2], "tag")
    # The layer reads "full", replaces "sliding", adds "extra".
    new_w, new_extra = torch.full((3,), 7.0), torch.full((1,), 9.0)
    fresh["sliding"] = (new_w, "tag2")
    fresh["extra"] = new_extra
    writes = collect_writes(bound)
    assert [key for key, _ in writes] == [CarriedKey(0, "sliding", 0), CarriedKey(0, "extra", 0)]
    assert writes[0][1] is new_w and writes[1][1] is new_extra
    # The Function's outputs for them land in the caller's mapping; what was read is untouched.
    outs = [t.clone() for _, t in writes]
    write_back(carried, [key for key, _ in writes], outs)
    assert caller["full"][0] is k and caller["full"][1] is v
    assert caller["sliding"] == (outs[0], "tag2") and caller["extra"] is outs[1]


def test_a_removed_entry_is_removed_from_the_callers_mapping():
    caller = UserDict({"a": torch.ones(1), "b": torch.zeros(1)})
    flat, carried = carry_mappings([caller])
    args, bound = bind_mappings(flat, 1)
    del args[0]["a"]
    assert collect_writes(bound) == []
    write_back(carried, [], [])
    assert list(caller) == ["b"]


def test_plain_dicts_are_not_carried():
    """A dict is flattened by pytree (its tensors are Function inputs already): never carried."""
    flat, carried = carry_mappings([{"a": 1}, UserDict()])
    assert carried == [flat[1]] and flat[0] == {"a": 1}
