"""Shard layouts (fpipe/_sharding/_layout.py, NOTE [shard layout]): how a stage's leaves are cut
into ``d`` flat, zero-padded shards, and the checks of a shard tree against its layout (the
gathers and reduce-scatters over real ranks: tests/sharding/test_stages.py)."""

from __future__ import annotations

import pytest
import torch

from fpipe._sharding._layout import check_shards, cut, cut_range, layout_of, norm_leaves


@pytest.mark.parametrize(
    ("numel", "shard", "expected"),
    [
        (10, None, (0, 10, 10)),
        (10, (0, 3), (0, 4, 4)),
        (10, (2, 3), (8, 10, 4)),  # the last shard holds 2 and 2 of padding
        (2, (3, 4), (2, 2, 1)),  # more shards than elements: empty ones, padded
        (0, (1, 2), (0, 0, 0)),
    ],
)
def test_cut_range(numel: int, shard: tuple[int, int] | None, expected: tuple[int, int, int]) -> None:
    assert cut_range(numel, shard) == expected


def test_shards_are_flat_padded_pieces_that_put_the_leaf_back() -> None:
    tree = {"w": torch.arange(10.0).reshape(2, 5), "n": 3, "ids": torch.arange(3)}
    layout = layout_of(tree, 3)
    assert [None if leaf is None else (leaf.shape, leaf.size) for leaf in layout.leaves] == [
        ((3,), 1),
        None,
        ((2, 5), 4),
    ]
    shards = [cut(tree, layout, q) for q in range(3)]
    assert all(s["n"] == 3 for s in shards)
    assert torch.equal(shards[2]["w"], torch.tensor([8.0, 9.0, 0.0, 0.0]))
    assert torch.equal(torch.cat([s["w"] for s in shards])[:10].reshape(2, 5), tree["w"])
    assert shards[0]["w"].data_ptr() != tree["w"].data_ptr()  # new tensors: the user's are not aliased
    for q, s in enumerate(shards):
        check_shards(q, s, layout)


def test_a_tree_that_is_no_shard_of_its_layout_is_named() -> None:
    tree = {"w": torch.zeros(2, 5, dtype=torch.float32)}
    layout = layout_of(tree, 2)
    with pytest.raises(ValueError, match="has no layout for stage 1"):
        check_shards(1, {"w": torch.zeros(5)}, None)
    with pytest.raises(ValueError, match=r"does not have the structure step\.shard recorded for stage 0"):
        check_shards(0, {"v": torch.zeros(5)}, layout)
    with pytest.raises(ValueError) as raised:
        check_shards(0, tree, layout)
    assert "params[0]['w'] should be this rank's shard of a torch.float32 tensor of shape (2, 5)" in str(raised.value)


def test_norm_leaves_match_the_layout() -> None:
    layout = layout_of({"w": torch.zeros(4), "n": 1}, 2)
    assert [(g.shape, p) for g, p in norm_leaves(0, {"w": torch.ones(2), "n": 1}, layout)] == [((2,), None)]
    with pytest.raises(ValueError, match=r"grads\[0\] has 1 leaf but stage 0's parameters have 2"):
        norm_leaves(0, {"w": torch.ones(2)}, layout)
    with pytest.raises(ValueError, match="the step has no layout for stage 3"):
        norm_leaves(3, {}, None)
