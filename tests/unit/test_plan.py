import pytest

from trainmover.groups.specs import GroupSpec, delta


def megatron_like_groups():
    # TP2 x PP2 x DP2 over 8 ranks: tp pairs, pp pairs, dp pairs, plus world.
    tp = [GroupSpec(f"tp{i}", (2 * i, 2 * i + 1)) for i in range(4)]
    pp = [GroupSpec("pp0", (0, 4)), GroupSpec("pp1", (1, 5)), GroupSpec("pp2", (2, 6)), GroupSpec("pp3", (3, 7))]
    dp = [GroupSpec("dp0", (0, 2)), GroupSpec("dp1", (1, 3)), GroupSpec("dp2", (4, 6)), GroupSpec("dp3", (5, 7))]
    return tp + pp + dp + [GroupSpec("world", tuple(range(8)))]


def test_only_groups_with_the_leaver_change():
    d = delta(megatron_like_groups(), {5}, epoch=1)
    assert {g.name for g in d.changed} == {"tp2", "pp1", "dp3", "world"}
    assert "tp0" in {g.name for g in d.untouched}
    assert len(d.changed) + len(d.untouched) == 13


def test_group_ranks_are_preserved_for_the_joiner_slot():
    d = delta(megatron_like_groups(), {5}, epoch=3)
    # rank 5 keeps its index in every group: the joiner builds with the same group rank.
    for g in d.groups_to_build(5):
        assert g.ranks.index(5) == next(x for x in megatron_like_groups() if x.name == g.name).ranks.index(5)
    assert {g.name for g in d.groups_to_build(0)} == {"world"}  # rank 0 shares only world with 5
    assert d.prefix(d.changed[0]).startswith("tm/e3/")


def test_whole_node_leaves_with_several_ranks():
    d = delta(megatron_like_groups(), {4, 5}, epoch=1)
    assert {g.name for g in d.changed} == {"tp2", "pp0", "pp1", "dp2", "dp3", "world"}


@pytest.mark.parametrize("leavers, epoch, message", [
    ({9}, 1, "not in the job"), (set(), 1, "not in the job"), ({1}, 0, "epoch"),
])
def test_bad_input_is_rejected(leavers, epoch, message):
    with pytest.raises(ValueError, match=message):
        delta(megatron_like_groups(), leavers, epoch)


def test_group_specs_are_validated():
    with pytest.raises(ValueError):
        GroupSpec("x", (1, 1))
    with pytest.raises(ValueError, match="unique"):
        delta([GroupSpec("a", (0, 1)), GroupSpec("a", (0,))], {0}, 1)
