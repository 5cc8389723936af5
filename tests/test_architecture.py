"""The house rules that code can check: imports only point down the floors of `bigdense/`, no two
modules reach each other, and every module stands on a floor (`bigdense.testing.floors`, also
``python -m bigdense.testing.floors``)."""
from bigdense.testing import floors


def test_imports_point_down_the_floors_and_never_in_a_circle():
    modules = floors.module_names()
    edges = floors.imports(modules)
    assert all(floors.floor_of(m) is not None for m in modules)  # (raises, naming a module with no floor)
    assert floors.upward(edges) == []
    assert floors.cycles(edges) == []
    assert sum(map(len, edges.values())) > 300  # the reader does see the package's imports


def test_the_checker_sees_an_upward_import_and_a_cycle():
    edges = {"bigdense.layers.linear": {"bigdense.train.clip"}, "bigdense.train.clip": {"bigdense.layers.linear"}}
    assert floors.upward(edges) == [("bigdense.layers.linear", "bigdense.train.clip")]
    assert floors.cycles(edges) == [["bigdense.layers.linear", "bigdense.train.clip", "bigdense.layers.linear"]]
