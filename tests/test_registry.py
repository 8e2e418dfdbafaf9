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
         "def build(p: P, spec: OnlyForTypeCheckers):\n    'my method'\n    return None\n",
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


# ----------------------------------------------------------------------------- one validation pass

COMBINATIONS = [  # config, --set, the error's start: each one used to wait for the first fit
    ("fedotp-fortunes", ["peft.type=adapter"], "algorithm 'fedotp' matches a global and a local prompt"),
    ("fedotp-fortunes", ["model.task=encoder_head"], "algorithm 'fedotp' matches an input's token features"),
    ("fedpurel-lora-fortunes", ["switch.grab={}"],
     "switch.grab re-weights the plain cross-entropy, and algorithm 'fedpurel'"),
    ("fedpgp-fortunes", ["switch.grab={}"], "switch.grab re-weights the plain cross-entropy, and algorithm 'fedpgp'"),
    ("fedpgp-fortunes", ["peft.type=adapter"], "algorithm 'fedpgp' adds a private low-rank correction"),
    ("pfedlora-fortunes", ["peft.type=prompt"], "algorithm 'pfedlora' trains a shared and a private LoRA adapter"),
    ("promptfolio-fortunes", ["peft.type=adapter"], "algorithm 'promptfolio' mixes a global and a local prompt"),
    ("fedclip-fortunes", ["peft.type=prompt"], "algorithm 'fedclip' federates one adapter (peft.type = 'adapter')"),
    ("promptfl-fortunes", ["peft.type=adapter"], "algorithm 'promptfl' federates one prompt (peft.type = 'prompt')"),
    ("fedavg-lora-minilm", ["algorithm=fedper"], "algorithm 'fedper' keeps a classification head private"),
    ("fedavg-lora-minilm", ["algorithm=full-ft"], "algorithm 'full-ft' trains every backbone weight"),
]


@pytest.mark.parametrize("name, sets, says", COMBINATIONS, ids=[f"{c[0]}:{c[1][0]}" for c in COMBINATIONS])
def test_validate_catches_every_combination_error_without_a_model(name, sets, says, capsys, tiny_zoo, no_weights):
    from fedsplice.app.cli import main

    args = ["validate", "--no-data", f"configs/{name}.toml"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"fedsplice: error: {says}"), err
    assert main(args[:3]) == 0  # the shipped config itself is fine
    capsys.readouterr()


def test_a_users_check_config_runs_in_validate(capsys, tiny_zoo):
    from fedsplice.app.cli import main

    def check_config(p, cfg):
        if cfg.model.task != "encoder_head":
            raise ConfigError("algorithm 'head-only' keeps a head private: set model.task = 'encoder_head'")
    register_algorithm("head-only", build=lambda p, spec: Recipe({n: "global" for n in spec.infos}),
                       check_config=check_config, replace=True)
    try:
        assert main(["validate", "--no-data", "--set", "algorithm=head-only", "--set", "method={}"]) == 2
        assert capsys.readouterr().err.strip() == ("fedsplice: error: algorithm 'head-only' keeps a head private: "
                                                   "set model.task = 'encoder_head'")
        assert main(["validate", "--no-data", "--set", "algorithm=head-only", "--set", "method={}",
                     "--set", "model.task=encoder_head"]) == 0
    finally:
        R.ALGORITHMS.pop("head-only")


def test_the_peft_settings_a_method_misreads_are_declared_by_the_method(capsys, tiny_zoo):
    """Algorithm.full_ok, not a list of names in the registry: a built-in says False unless it
    declares True; a registered method (None) is not checked. A method's own LoRA adapters are its
    LoraParts (pFedLoRA's, FedDPA's and FLoRA's dense base)."""
    from fedsplice.app.cli import main

    full = {n for n, a in R.ALGORITHMS.items() if a.full_ok}
    assert full == {"full-ft", "fedprox", "fedper", "local", "zeroshot", "centralized", "majority", "local-prior"}
    assert {n for n, a in R.ALGORITHMS.items() if a.lora_parts} == {"pfedlora", "feddpa", "flora"}
    assert main(["validate", "--no-data", "--set", "peft.type=full"]) == 2  # the default is PFAdapter
    assert "peft.type = 'full' trains the whole backbone" in capsys.readouterr().err
    register_algorithm("mine", build=lambda p, spec: Recipe({n: "global" for n in spec.infos}), replace=True)
    try:
        assert main(["validate", "--no-data", "--set", "algorithm=mine", "--set", "method={}",
                     "--set", "peft.type=full"]) == 0
    finally:
        R.ALGORITHMS.pop("mine")
    capsys.readouterr()


@pytest.mark.parametrize("sets, label", [
    ([], "pfadapter"),
    (["server.optimizer=fedadam"], "pfadapter+fedadam"),
    (["algorithm=lora"], "fedavg-lora"),
    (["algorithm=lora", "server.optimizer=fedyogi"], "fedyogi-lora"),
    (["algorithm=local", "server.optimizer=fedadam"], "local"),
    (["algorithm=majority", "server.optimizer=fedadam"], "majority"),
    (["algorithm=fedpurel", "peft.type=prompt", "server.optimizer=fedadam"], "fedpurel+fedadam-prompt"),
    (["algorithm=fedpurel", "switch.logit_adjustment.tau=1.0"], "fedpurel-lora+la"),
    (["algorithm=lora", "switch.grab={}"], "fedavg-lora+grab"),
    (["algorithm=lora", "switch.grab={}", "client.logit_adjustment=1.0"], "fedavg-lora+la+grab"),
])
def test_labels_come_from_the_methods(sets, label):
    """display_name: each method's own `label` (lora, fedpurel, the methods without a server step)
    or `algorithm` (+ the server optimizer), then the +la / +grab switches: the names results use."""
    from fedsplice.federation.validate import load_config

    method = [] if not any(s.startswith("algorithm=") for s in sets) else ["method={}"]
    assert R.display_name(load_config(None, sets + method)) == label


def test_a_build_of_the_earlier_four_argument_form_still_runs_with_a_warning():
    """build(params, infos, shapes, scalings) was the form before ModelSpec: it is called with the
    spec's three parts and gives the recipe the spec form gives, with one FutureWarning."""
    from fedsplice.algorithms import ModelSpec, build_recipe
    from fedsplice.config import ExperimentConfig
    from fedsplice.core.split import ParamInfo

    seen = {}

    def old(p, infos, shapes, scalings):
        seen.update(shapes=dict(shapes), scalings=dict(scalings))
        return Recipe({n: "global" if i.role == "q" else "private" for n, i in infos.items()})

    with pytest.warns(FutureWarning, match=r"write build\(params, spec\)"):
        register_algorithm("old-form", build=old, replace=True)
    register_algorithm("new-form", build=lambda p, spec: Recipe(
        {n: "global" if i.role == "q" else "private" for n, i in spec.infos.items()}), replace=True)
    infos = {"l0.q.A": ParamInfo("q", "A", "0", "lora"), "l0.v.A": ParamInfo("v", "A", "0", "lora")}
    spec = ModelSpec(infos, {"l0.q.A": (4, 8), "l0.v.A": (4, 8)}, {"l0.q.A": 2.0, "l0.v.A": 2.0})
    try:
        old_r, new_r = (build_recipe(ExperimentConfig(algorithm=a), spec) for a in ("old-form", "new-form"))
        assert old_r.split == new_r.split == {"l0.q.A": "global", "l0.v.A": "private"}
        assert seen == {"shapes": dict(spec.shapes), "scalings": dict(spec.scalings)}
    finally:
        R.ALGORITHMS.pop("old-form")
        R.ALGORITHMS.pop("new-form")
