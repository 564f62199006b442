"""A load's template (fpipe/_saving/_template.py): the names its leaves want, checked before
anything is read, and the trees filled with what was read (whole loads: tests/saving/test_save.py)."""

from __future__ import annotations

import pytest
import torch

from fpipe._saving._store import Part
from fpipe._saving._template import fill, label, listing, template_uses


def test_uses_name_each_leaf_by_its_key_path() -> None:
    trees = [{"embed": torch.zeros(2), "layers": [{"w": torch.zeros(3)}]}, None, {"embed": torch.zeros(2), "n": None}]
    uses = template_uses("fpipe.load", "params", trees, None)
    assert {name: [(u.where, u.stage, u.position) for u in us] for name, us in uses.items()} == {
        "embed": [("template[0]['embed']", 0, 0), ("template[2]['embed']", 2, 0)],
        "layers.0.w": [("template[0]['layers'][0]['w']", 0, 1)],
    }
    assert uses["embed"][0].part == Part() and uses["embed"][0].full_shape == [2]


@pytest.mark.parametrize(
    ("trees", "error", "fragment"),
    [
        ([{"w": 1.0}], TypeError, "fpipe.load: template[0]['w'] is a float; template leaves are tensors"),
        ([torch.zeros(1)], TypeError, "is a tensor at the root of stage 0, so it has no name"),
        ([{"a": {"b": torch.zeros(1)}, "a.b": torch.zeros(1)}], ValueError, "both get the name 'a.b'"),
    ],
)
def test_a_template_without_names_fails_before_reading(trees: list, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error) as raised:
        template_uses("fpipe.load", "params", trees, None)
    assert fragment in str(raised.value)


def test_fill_puts_each_tensor_read_in_its_leaves() -> None:
    trees = [{"w": torch.zeros(2, device="meta")}, {"w": torch.zeros(2), "n": None}]
    uses = template_uses("fpipe.load", "params", trees, None)
    read = torch.tensor([1.0, 2.0])
    filled = fill(trees, uses, {("w", Part()): read})
    assert filled[0]["w"] is read  # a meta leaf takes the tensor as read (on the CPU)
    assert torch.equal(filled[1]["w"], read) and filled[1]["w"] is not read  # a second use: a copy
    assert filled[1]["n"] is None and trees[1]["w"].sum() == 0  # the template is not changed


def test_labels_and_listings() -> None:
    assert (label("params"), label("optimizer_state")) == ("template", "optimizer_state")
    assert listing(["a", "b"]) == "[a, b]"
    assert listing([str(k) for k in range(12)], limit=3) == "[0, 1, 2, ... 9 more]"
