"""Where a rank's pieces sit in the canonical tensors (``runtime.checkpoint.mapping``): every
element of a flat range of a TP shard lands, through the boxes, where Megatron's rule puts it
(partition dim, stride sub-blocks, vocabulary padding dropped); the shards of all TP ranks tile
the canonical tensor exactly once."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from canzona.runtime.checkpoint.mapping import ParamView, axis_of, megatron_axis  # noqa: E402
from canzona.runtime.checkpoint.pieces import Pieces  # noqa: E402


def _expected(dim, stride, tp, rank, local, logical_len):
    """Per local (row, col), its canonical (row, col) by Megatron's rule, None for padding."""
    out = {}
    R, C = local
    L = local[dim]
    b = L // stride
    for r in range(R):
        for c in range(C):
            x = (r, c)[dim]
            s, off = divmod(x, b)
            canon = (s * tp + rank) * b + off
            if canon >= logical_len:
                out[(r, c)] = None
            else:
                out[(r, c)] = (canon, c) if dim == 0 else (r, canon)
    return out


@settings(max_examples=150, deadline=None)
@given(dim=st.sampled_from([0, 1]), stride=st.sampled_from([1, 2]), tp=st.sampled_from([1, 2, 4]),
       sub=st.integers(1, 3), other=st.integers(1, 5), pad=st.integers(0, 5), data=st.data())
def test_boxes_put_every_element_where_megatron_does(dim, stride, tp, sub, other, pad, data):
    L = sub * stride
    full = L * tp
    logical_len = max(1, full - (pad if dim == 0 and stride == 1 else 0))
    local = (L, other) if dim == 0 else (other, L)
    logical = (logical_len, other) if dim == 0 else (other, logical_len)
    seen = {}
    for rank in range(tp):
        view = ParamView("w", logical, local, megatron_axis(dim, L, stride, tp, rank, logical_len))
        n = local[0] * local[1]
        a = data.draw(st.integers(0, n))
        b = data.draw(st.integers(a, n))
        flat = torch.arange(n, dtype=torch.float64)[a:b].clone()
        want = _expected(dim, stride, tp, rank, local, logical_len)
        got = {}
        for (o0, o1), t in view.pieces(flat, a, b):
            for i in range(t.shape[0]):
                for j in range(t.shape[1]):
                    e = int(t[i, j])
                    got[divmod(e, local[1])] = (o0 + i, o1 + j)
        inside = {divmod(e, local[1]) for e in range(a, b)}
        assert got == {k: v for k, v in want.items() if k in inside and v is not None}
        for k, v in got.items():
            assert v not in seen, "two ranks wrote the same canonical element"
            seen[v] = (rank, k)
        # the whole shard: every non-padding element once
        whole = view.pieces(torch.zeros(n), 0, n)
        assert sum(t.numel() for _, t in whole) == sum(v is not None for v in want.values())


def test_pieces_are_views_that_load_in_place():
    view = ParamView("w", (6, 4), (3, 4), megatron_axis(0, 3, 1, 2, 1, 6))
    flat = torch.zeros(12)
    (off, t), = view.pieces(flat, 0, 12)
    assert off == (3, 0)
    t.fill_(7)
    assert bool((flat == 7).all())
    with pytest.raises(ValueError, match="outside the logical tensor"):
        Pieces((6, 4), [((4, 0), torch.zeros(3, 4))])


def test_vector_and_padded_vocabulary_at_tp1():
    w = torch.nn.Parameter(torch.arange(128.0 * 4).view(128, 4))
    view = ParamView("emb", (100, 4), (128, 4), axis_of(w, (100, 4), 1, 0))
    (off, t), = view.pieces(w.detach().view(-1), 0, 512)
    assert off == (0, 0) and t.shape == (100, 4)
    v = torch.nn.Parameter(torch.arange(6.0))
    vv = ParamView("norm", (6,), (6, 1), axis_of(v, (6,), 2, 0))
    (off, t), = vv.pieces(v.detach().view(-1)[2:5], 2, 5)
    assert off == (2,) and t.tolist() == [2.0, 3.0, 4.0]
