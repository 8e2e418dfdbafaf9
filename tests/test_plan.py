"""Plan, then load (fedsplice.federation.plan): the recipe and every check that combines it with the
rest of the config, from the model's skeleton on the meta device, before any weight loads.
`fedsplice validate` runs the plan; a run plans first and loads exactly the planned tensors."""

import subprocess
import sys

import pytest

from fedsplice.app.cli import main
from fedsplice.app.rundir import write_config
from fedsplice.federation.experiment import build, build_data
from fedsplice.federation.plan import check_loaded, plan

# issue 49: these passed `fedsplice validate` and failed only after the weights had loaded
REFUSED = {  # the config as written, what --set adds, what the one line says
    "prompt on an encoder + head": (dict(algorithm='"promptfl"', peft__type='"prompt"'), ['model.task="encoder_head"'],
                                    "peft.type = 'prompt' learns the class prompts of a dual encoder"),
    "centralized with FedYogi": (dict(algorithm='"centralized"'), ['server.optimizer="fedyogi"'],
                                 "it needs server.optimizer = 'fedavg'"),
    "hetlora under central DP": (dict(algorithm='"hetlora"'), ['privacy.mode="central"', "privacy.clip=1.0",
                                                                "privacy.noise_multiplier=1.0"],
                                 "algorithm 'hetlora' weighs each tensor by its own rule"),
    "fedpurel with DP-SGD": (dict(algorithm='"fedpurel"'),
                             ['privacy.local="dpsgd"', "privacy.local_noise_multiplier=1.0"],
                             "algorithm 'fedpurel' trains with a loss or gradient rule of its own"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_validate_refuses_the_combination_before_any_weight_loads(case, tiny_cfg, tmp_path, capsys, no_weights,
                                                                   monkeypatch):
    """Each is a config-only combination: refused before the skeleton too (the model's code not
    imported: under 3 s), so also where the model's config cannot be read (a hub id offline)."""
    def no_skeleton(*a, **k):
        raise AssertionError("the combination is refused before the plan builds the skeleton")
    monkeypatch.setattr("fedsplice.federation.plan.TaskModel", no_skeleton)
    written, sets, says = REFUSED[case]
    write_config(tmp_path, tiny_cfg(**written))
    args = ["validate", "--no-data", str(tmp_path / "config.toml")]
    for kv in sets:
        args += ["--set", kv]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_validate_plans_a_good_config_without_weights(tiny_cfg, tmp_path, capsys, no_weights):
    write_config(tmp_path, tiny_cfg())  # PFAdapter: q/k LoRA GLOBAL, v/o PRIVATE
    assert main(["validate", "--no-data", str(tmp_path / "config.toml")]) == 0
    out = capsys.readouterr().out
    n = sum(1 for _ in plan(tiny_cfg()).global_names)
    assert f"plan: {n} GLOBAL and {n} PRIVATE tensors" in out and n > 0


@pytest.mark.parametrize("sets", [dict(), dict(algorithm='"feddpa"', method="{}"),
                                  dict(algorithm='"hetlora"', method="{}"),
                                  dict(algorithm='"fedotp"', method="{}", peft__type='"prompt"'),
                                  dict(algorithm='"fedclip"', method="{}", peft__type='"adapter"'),
                                  dict(model__task='"encoder_head"', algorithm='"lora"', method="{}")])
def test_the_plan_is_the_loaded_model(tiny_cfg, sets):
    """With the data's class names the skeleton has the loaded model's tensors: names, shapes,
    roles, LoRA scalings; a plan without the data names the same tensors."""
    cfg = tiny_cfg(**sets)
    data, _, _ = build_data(cfg)
    planned = plan(cfg, data.class_names, data.class_prompt)
    exp = build(cfg)  # which itself plans and checks the loaded model against it
    params = exp.model.trainable()
    assert planned.shapes == {n: tuple(p.shape) for n, p in params.items()}
    assert planned.infos == exp.model.param_infos() and planned.scalings == exp.model.scalings()
    assert (planned.global_names, planned.private_names) == (exp.global_names, exp.private_names)
    assert set(plan(cfg).shapes) == set(planned.shapes)


def test_a_model_that_differs_from_its_plan_is_refused(tiny_cfg):
    cfg = tiny_cfg()
    exp = build(cfg)
    planned = plan(cfg, exp.data.class_names)
    check_loaded(planned, exp.model)
    name = planned.global_names[0]
    wrong = type(planned)(planned.recipe, planned.infos, {**planned.shapes, name: (1, 1)}, planned.scalings,
                          planned.global_names, planned.private_names)
    with pytest.raises(RuntimeError, match="trainable shapes differ from the plan's"):
        check_loaded(wrong, exp.model)


QUANTIZED_AFTER_PLAIN = """
import sys
from fedsplice.federation.experiment import build
sys.path.insert(0, {tests!r})
from conftest import make_cfg
plain = build(make_cfg({llama!r}, {data!r}, model__task='"causal_lm"', algorithm='"lora"', method="{{}}"))
assert "bitsandbytes" not in sys.modules, "an unquantized LoRA model imported bitsandbytes"
import bitsandbytes as bnb
exp = build(make_cfg({llama!r}, {data!r}, model__task='"causal_lm"', model__quantization='"nf4"',
                     runtime__precision='"bf16"', algorithm='"lora"', method="{{}}"))
assert any(isinstance(m, bnb.nn.Linear4bit) for m in exp.model.backbone.modules())
print("ok", sorted(exp.model.trainable()) == sorted(plain.model.trainable()))
"""


@pytest.mark.integration
def test_bitsandbytes_is_imported_only_for_a_quantized_base(tiny_llama_dir, toy_jsonl, tmp_path):
    """peft imports bitsandbytes (seconds) at its own import and at every LoRA injection; an
    unquantized base now never imports it, and a quantized base later in the same process still
    loads in 4 bits with LoRA on it (the cached availability checks were cleared)."""
    from pathlib import Path

    code = QUANTIZED_AFTER_PLAIN.format(tests=str(Path(__file__).parent), llama=str(tiny_llama_dir),
                                        data=str(toy_jsonl))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "ok True"


@pytest.mark.parametrize("sets", [dict(peft__r=2**30),  # LoRA: 2**30 x the width a factor, 100+ GiB on the host
                                  dict(algorithm='"fedclip"', method="{}", peft__type='"adapter"',
                                       peft__adapter_hidden=2**30)])
def test_the_skeleton_allocates_no_trainable_tensor(tiny_cfg, no_weights, sets):
    """The plan's trainable modules live on the meta device too: a rank or a size no machine could
    hold is planned (and refused or run later) without allocating it. A fuzzed peft.r of 1.4e8
    made `fedsplice validate` try to allocate 18 GB (tests/test_config_fuzz.py)."""
    from fedsplice.federation.plan import PLACEHOLDER_CLASSES
    from fedsplice.model.taskmodel import TaskModel

    planned = plan(tiny_cfg(**sets))
    assert max(max(s) for s in planned.shapes.values()) == 2**30 and planned.global_names
    skeleton = TaskModel(tiny_cfg(**{k: v for k, v in sets.items() if k not in ("peft__r", "peft__adapter_hidden")}),
                         PLACEHOLDER_CLASSES, skeleton=True)
    assert all(p.is_meta for p in skeleton.trainable().values())
