import pytest

from services.mesh import MeshShape


def test_tp_innermost_dp_outermost():
    m = MeshShape(dp=2, pp=2, tp=2)
    assert [tuple(m.coord(r)) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert m.group("tp", 5) == [4, 5]
    assert m.group("pp", 5) == [5, 7]
    assert m.group("dp", 5) == [1, 5]
    assert m.replica(1) == [4, 5, 6, 7]


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 4), (4, 1, 2), (3, 2, 1)])
def test_round_trip_and_groups_partition_the_world(shape):
    m = MeshShape(*shape)
    assert [m.rank(m.coord(r)) for r in range(m.world_size)] == list(range(m.world_size))
    for axis, size in zip(("dp", "pp", "tp"), shape, strict=True):
        groups = m.groups(axis)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(m.world_size))


def test_out_of_range():
    m = MeshShape(2, 1, 2)
    with pytest.raises(ValueError):
        m.coord(4)
    with pytest.raises(ValueError):
        m.rank((0, 1, 0))
    with pytest.raises(ValueError):
        MeshShape(0, 1, 1)


def test_render_shows_every_rank():
    text = MeshShape(2, 2, 2).render()
    assert text.splitlines()[0] == "dp=0"
    assert all(f"{r:>4}" in text for r in range(8))
