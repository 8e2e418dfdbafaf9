"""The algorithm registry: names, `module:object` references and entry points fail as one-line
ConfigErrors naming what to fix, never as tracebacks."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from fedsplice.algorithms import NoParams, Recipe, get_algorithm, register_algorithm
from fedsplice.algorithms import registry as R
from fedsplice.errors import ConfigError


@pytest.mark.parametrize("ref, why", [
    (":build", "Empty module name"),
    (".m:build", "relative import"),
    ("no_such_pkg.mod:build", "No module named 'no_such_pkg'"),
    ("json:no_such_name", "has no attribute"),
    ("functools:partial", "first parameter"),
])
def test_bad_references_are_config_errors(ref, why):
    with pytest.raises(ConfigError, match=why) as e:
        get_algorithm(ref)
    assert "\n" not in str(e.value)


def test_only_the_first_annotation_is_read(monkeypatch):
    """Other parameters may name types that exist only under TYPE_CHECKING."""
    mod = types.ModuleType("myalgo_mod")
    monkeypatch.setitem(sys.modules, "myalgo_mod", mod)  # dataclasses look their module up
    exec("from __future__ import annotations\nimport dataclasses\n"
         "@dataclasses.dataclass\nclass P:\n    k: int = 3\n"
         "def build(p: P, infos: OnlyForTypeCheckers, shapes, scalings):\n    'my method'\n    return None\n",
         mod.__dict__)
    algo = get_algorithm("myalgo_mod:build")
    assert algo.params is mod.P and algo.description == "my method"


def test_register_refuses_to_shadow_and_bad_types():
    @dataclasses.dataclass
    class P:
        x: float = 1.0

    with pytest.raises(ConfigError, match="already registered"):
        register_algorithm("pfadapter", P, lambda p, *a: Recipe({}))
    with pytest.raises(ConfigError, match="must be a dataclass"):
        register_algorithm("mine-x", dict, lambda p, *a: Recipe({}))
    try:
        a = register_algorithm("mine-x", P, lambda p, *a: Recipe({}), description="d")
        assert get_algorithm("mine-x") is a and a.params is P
    finally:
        R.ALGORITHMS.pop("mine-x", None)


class _EP:
    def __init__(self, name, value, obj=None, exc=None):
        self.name, self.value, self._obj, self._exc = name, value, obj, exc

    def load(self):
        if self._exc:
            raise self._exc
        return self._obj


def test_a_broken_entry_point_is_named_not_raised(monkeypatch):
    good = _EP("ep-good", "pkg:build", obj=lambda p, *a: Recipe({}))
    broken = _EP("ep-broken", "pkg.bad:build", exc=ImportError("no module pkg.bad"))
    shadow = _EP("pfadapter", "other:build", obj=lambda p, *a: Recipe({}))
    monkeypatch.setattr(R, "entry_points", lambda group: [good, broken, shadow])
    with pytest.warns(UserWarning, match="shadowed"):
        out = R.available()
    assert out["ep-good"].params is NoParams
    assert out["ep-broken"].description.startswith("BROKEN: algorithm: entry point ep-broken")
    assert out["pfadapter"] is R.ALGORITHMS["pfadapter"]
    with pytest.raises(ConfigError, match="fails to load .*fix or uninstall"):
        get_algorithm("ep-broken")
