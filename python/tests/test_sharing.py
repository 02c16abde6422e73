"""Tensors through torchpar's queues: shared, not copied, under each start method and
sharing strategy.

A child's in-place write to a tensor it got from a Queue is seen by the parent; views and
tensors sharing one storage stay aliased within a message; nn.Parameter keeps its type and
requires_grad; a non-leaf tensor requiring grad is refused (RuntimeError, as
torch.multiprocessing); numpy arrays round-trip equal (large ones out of band); a dict of
16 tensors arrives whole.
"""
import numpy as np
import pytest
import torch

import torchpar.multiprocessing as tmp

import tp_helpers
from tp_helpers import WAIT_S


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_child_write_is_seen_by_parent(method, strategy):
    ctx = tmp.get_context(method)
    base = torch.zeros(8)
    view = base[2:5]                  # a view of base, in the same message
    pair = torch.arange(6.0)
    b, c = pair[:3], pair.view(2, 3)  # two tensors over one storage
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = tp_helpers.start(ctx, tp_helpers.write_in_place, q_in, q_out, strategy)
    q_in.put((base, view, b, c))
    seen = tp_helpers.get_from(q_out, p)
    assert tp_helpers.finish(p) == 0
    assert seen["view_aliases"] and seen["b_c_share"] and seen["shared"], seen
    expected = [42.0, 0.0, 7.0, 7.0, 7.0, 0.0, 0.0, 0.0]
    assert seen["a_after"] == expected
    assert base.tolist() == expected             # the child's writes, seen here
    assert view.tolist() == [7.0, 7.0, 7.0]
    assert pair.tolist() == [1.0, 2.0, 3.0, 3.0, 4.0, 5.0]
    assert seen["c_after"] == [[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]]
    assert tmp.is_shared(base) and tmp.is_shared(pair)  # moved to shared memory in place


def test_parameter_keeps_type_and_requires_grad(ctx):
    param = torch.nn.Parameter(torch.randn(3, 4))
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    leaf = torch.ones(5, requires_grad=True)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = tp_helpers.start(ctx, tp_helpers.parameter_report, q_in, q_out,
                          "file_descriptor")
    q_in.put((param, leaf))
    report = tp_helpers.get_from(q_out, p)
    back_p, back_leaf = tp_helpers.get_from(q_out, p)
    assert tp_helpers.finish(p) == 0
    assert report == {"p_type": "Parameter", "p_grad": True,
                      "leaf_type": "Tensor", "leaf_grad": True}
    assert type(back_p) is torch.nn.Parameter and back_p.requires_grad
    assert torch.equal(back_p.detach(), param.detach())
    assert type(back_leaf) is torch.Tensor and back_leaf.requires_grad and back_leaf.is_leaf
    # In one process too, and a Parameter with requires_grad False.
    q = ctx.Queue()
    q.put({"frozen": frozen, "bare": leaf})
    d = q.get(timeout=WAIT_S)
    assert type(d["frozen"]) is torch.nn.Parameter and not d["frozen"].requires_grad
    q.put(leaf)  # a bare tensor takes the short path
    bare = q.get(timeout=WAIT_S)
    assert bare.requires_grad and bare.is_leaf


def test_non_leaf_requiring_grad_is_refused(any_ctx):
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    q = any_ctx.Queue()
    with pytest.raises(RuntimeError, match="non-leaf tensor"):
        q.put(y)
    with pytest.raises(RuntimeError, match="non-leaf tensor"):
        q.put({"nested": [y]})
    a, b = any_ctx.Pipe()
    with pytest.raises(RuntimeError, match="non-leaf tensor"):
        a.send((1, y))
    q.put(y.detach())  # the queue is still usable
    assert torch.equal(q.get(timeout=WAIT_S), torch.full((3,), 2.0))
    assert not b.poll(0)


def test_numpy_and_dict_of_16_tensors_round_trip(ctx, strategy):
    payload = tp_helpers.numpy_roundtrip_payload()
    d = tp_helpers.tensor_dict(16)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = tp_helpers.start(ctx, tp_helpers.echo, q_in, q_out, strategy)
    q_in.put(payload)
    back = tp_helpers.get_from(q_out, p)
    assert back.keys() == payload.keys()
    for k, v in payload.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        np.testing.assert_array_equal(back[k], v)
    back["large"][0, 0] = 1.0  # a received out-of-band array is writable, as pickle's
    for _ in range(3):
        q_in.put(d)
        back = tp_helpers.get_from(q_out, p)
        assert list(back) == list(d)
        for k in d:
            assert back[k].dtype == d[k].dtype and torch.equal(back[k], d[k]), k
    q_in.put(None)
    assert tp_helpers.finish(p) == 0


def test_share_memory_and_empty_shared(strategy):
    t = torch.arange(12.0).view(3, 4)
    v = t[1]
    assert not tmp.is_shared(t)
    assert tmp.share_memory_(t) is t
    assert tmp.is_shared(t) and tmp.is_shared(v)
    assert t.tolist()[1] == v.tolist() == [4.0, 5.0, 6.0, 7.0]
    v.zero_()
    assert t[1].sum() == 0  # the view still aliases the moved storage
    e = tmp.empty_shared(2, 3, dtype=torch.int64)
    assert e.shape == (2, 3) and e.dtype == torch.int64 and tmp.is_shared(e)
    assert tmp.empty_shared((4,)).shape == (4,)
    assert tmp.get_sharing_strategy() == strategy
    assert tmp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}
    with pytest.raises(ValueError):
        tmp.set_sharing_strategy("no_such_strategy")
