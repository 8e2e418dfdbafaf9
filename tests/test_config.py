"""Config loading: field-level errors that name the dotted key, --set parsing, shipped configs."""

from pathlib import Path

import pytest

from fedsplice.app.rundir import write_config
from fedsplice.config import (
    DEFAULT_CONFIG,
    ExperimentConfig,
    apply_overrides,
    from_dict,
    parse_value,
    read_toml,
    to_dict,
)
from fedsplice.errors import ConfigError
from fedsplice.federation.validate import load_config  # parse + leaf checks + the cross-checks

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _err(overrides, path=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    msg = str(e.value)
    assert "\n" not in msg  # one line for the CLI
    return msg


def test_embedded_default_validates():
    cfg = load_config()
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.algorithm == "pfadapter" and cfg.model.name == "zoo:minilm"
    assert cfg.method == {"global_roles": ["q", "k"], "ortho_lambda": 0.1}
    assert cfg.peft.roles == ["q", "k", "v", "o"] and cfg.peft.r == 8 and cfg.peft.alpha == 16.0
    assert cfg.data.holdout_clients == 2 and cfg.server.clients_per_round == 4
    assert cfg == load_config(DEFAULT_CONFIG)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.server.rounds >= 1


def test_roundtrip_through_to_dict():
    cfg = load_config(None, ["server.rounds=3", "peft.layers=[0]"])
    assert from_dict(ExperimentConfig, to_dict(cfg)) == cfg


@pytest.mark.parametrize("override,key", [
    ("roundz=3", "roundz"),
    ("server.roundz=3", "server.roundz"),
    ("model.nme='x'", "model.nme"),
    ("method.gloabl_roles=['q']", "method.gloabl_roles"),
])
def test_unknown_field_names_the_dotted_key(override, key):
    msg = _err([override])
    assert msg.startswith(f"{key}: unknown config field")


def test_unknown_field_in_a_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('algorithm = "lora"\n[client]\nlr = 0.1\nbatchsize = 4\n')
    assert _err([], p).startswith("client.batchsize: unknown config field")


@pytest.mark.parametrize("override,needle", [
    ('server.rounds="x"', "server.rounds: expected an integer, got 'x'"),
    ("server.rounds=2.5", "server.rounds: expected an integer"),
    ("server.rounds=true", "server.rounds: expected an integer"),
    ("client.lr='fast'", "client.lr: expected a number"),
    ("runtime.threads=[1]", "runtime.threads: expected an integer"),
    ("peft.use_rslora=1", "peft.use_rslora: expected true or false"),
    ("peft.roles='q'", "peft.roles: expected a list"),
    ("peft.layers=['a']", "peft.layers[0]: expected an integer"),
    ("model.name=3", "model.name: expected a string"),
    ("server=3", "server: expected a table"),
    ("method=3", "method: expected a table"),
])
def test_wrong_types(override, needle):
    assert needle in _err([override])


@pytest.mark.parametrize("override,key", [
    ("server.optimizer=sgd", "server.optimizer"),
    ("model.task=seq2seq", "model.task"),
    ("data.partition=random", "data.partition"),
    ("runtime.store=s3", "runtime.store"),
    ("client.optimizer=adam", "client.optimizer"),
])
def test_literal_choices(override, key):
    msg = _err([override])
    assert msg.startswith(f"{key}: unknown value") and "choose one of" in msg


def test_literal_choice_lists_the_options():
    msg = _err(["server.optimizer=sgd"])
    for opt in ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"):
        assert opt in msg


@pytest.mark.parametrize("override,needle", [
    ("data.alpha=0", "data.alpha must be > 0"),
    ("data.alpha=-1.0", "data.alpha must be > 0"),
    ("peft.roles=['x']", "peft.roles: unknown role(s) ['x']"),
    ("peft.roles=[]", "peft.roles is empty"),
    ("peft.r=0", "peft.r must be > 0"),
    ("peft.dropout=1.0", "peft.dropout must be in [0, 1)"),
    ("peft.layers=[-1]", "peft.layers"),
    ("server.rounds=0", "server.rounds must be > 0"),
    ("server.lr=-1.0", "server.lr must be >= 0"),
    ("client.max_steps=-1", "client.max_steps must be >= 0"),
    ("client.batch_size=0", "client.batch_size must be > 0"),
    ("data.holdout_clients=10", "data.holdout_clients must be in [0, data.num_clients)"),
    ("data.max_per_class=-2", "data.max_per_class must be >= 0"),
    ("eval.every=0", "eval.every must be > 0"),
    ("eval.cold_start_epochs=-1", "eval.cold_start_epochs must be >= 0"),
    ("data.class_prompt='no label here'", "data.class_prompt must contain '{label}'"),
    ("model.class_prompt='a {label}'", "model.class_prompt moved to data.class_prompt"),
    ("data.test='test.csv'", "data.test = 'test.csv': give csv:PATH, jsonl:PATH or images:DIR"),
    ("data.test='csv:/nonexistent/t.csv'", "data.test: file '/nonexistent/t.csv' not found"),
    ("model.input_template='no text'", "model.input_template must contain '{text}'"),
    ("method.global_roles=[]", "method.global_roles is empty"),
    ("method.global_roles=['z']", "method.global_roles: unknown role(s) ['z']"),
    ("method.ortho_lambda=-0.1", "method.ortho_lambda must be >= 0"),
])
def test_out_of_range(override, needle):
    assert needle in _err([override])


def test_clients_per_round_cannot_exceed_training_clients():
    # default: 10 clients, 2 held out -> 8 train
    assert "server.clients_per_round (9) exceeds the 8 training clients" in _err(["server.clients_per_round=9"])
    load_config(None, ["server.clients_per_round=8"])
    assert "exceeds the 5" in _err(["data.holdout_clients=5", "server.clients_per_round=6"])


def test_unknown_algorithm():
    msg = _err(["algorithm=fedmagic"])
    assert msg.startswith("algorithm: unknown 'fedmagic'") and "pfadapter" in msg and "lora" in msg


def test_method_field_the_algorithm_does_not_take():
    msg = _err(["algorithm=lora", "method={}", "method.ortho_lambda=0.1"])
    assert msg.startswith("method.ortho_lambda: unknown config field")
    assert "has no [method] fields" in msg
    msg = _err(["algorithm=fedprox", "method={}", "method.global_roles=['q']"])
    assert msg.startswith("method.global_roles: unknown config field") and "mu" in msg
    cfg = load_config(None, ["algorithm=fedprox", "method={}", "method.mu=0.5"])
    assert cfg.method == {"mu": 0.5}
    assert "method.mu must be >= 0" in _err(["algorithm=fedprox", "method={mu=-1.0}"])


@pytest.mark.parametrize("text,value", [
    ("3", 3), ("-2", -2), ("0.5", 0.5), ("1e-3", 1e-3), ("true", True), ("false", False),
    ("[1, 2]", [1, 2]), ('["q","k"]', ["q", "k"]), ("'quoted'", "quoted"), ('"dq"', "dq"),
    ("lora", "lora"), ("zoo:minilm", "zoo:minilm"), ("jsonl:/tmp/a b.jsonl", "jsonl:/tmp/a b.jsonl"),
    ("{}", {}), ("{mu = 0.1}", {"mu": 0.1}),
])
def test_set_value_parsing(text, value):
    got = parse_value(text)
    assert got == value and type(got) is type(value)


def test_apply_overrides_nested_and_errors():
    t = apply_overrides({"server": {"rounds": 1}}, ["server.rounds=4", "a.b.c=x", " seed = 7"])
    assert t == {"server": {"rounds": 4}, "a": {"b": {"c": "x"}}, "seed": 7}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["server.rounds"])
    with pytest.raises(ConfigError, match="rounds is not a table"):
        apply_overrides({"server": {"rounds": 1}}, ["server.rounds.x=1"])


def test_set_overrides_go_through_the_same_checks():
    cfg = load_config(None, ["server.rounds=3", "client.lr=0.01", "peft.roles=['q','v']",
                             "model.name=/some/path", "server.optimizer=fedyogi"])
    assert cfg.server.rounds == 3 and cfg.client.lr == 0.01 and isinstance(cfg.client.lr, float)
    assert cfg.peft.roles == ["q", "v"] and cfg.model.name == "/some/path"
    cfg = load_config(None, ["data.alpha=1"])  # an integer where a float is expected is fine
    assert cfg.data.alpha == 1.0 and isinstance(cfg.data.alpha, float)


def test_missing_and_invalid_files(tmp_path):
    assert "config file not found" in _err([], tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\nrounds = 2\n")
    assert "not valid TOML" in _err([], bad)
    with pytest.raises(ConfigError):
        read_toml(tmp_path)  # a folder is not a config file


def test_server_optimizer_kwargs_only_what_it_takes():
    cfg = load_config(None, ["server.optimizer=fedavg"])
    assert cfg.server.optimizer_kwargs() == {}
    cfg = load_config(None, ["server.optimizer=fedavgm", "server.lr=0.5"])
    assert cfg.server.optimizer_kwargs() == {"lr": 0.5, "momentum": 0.9}
    cfg = load_config(None, ["server.optimizer=fedyogi", "server.initial_accumulator=0.0"])
    assert cfg.server.optimizer_kwargs() == {"beta1": 0.9, "beta2": 0.99, "bias_correction": False,
                                             "tau": 1e-3, "initial_accumulator": 0.0}
    cfg = load_config(None, ["server.optimizer=fedadagrad"])
    assert cfg.server.optimizer_kwargs() == {"tau": 1e-3}
    cfg = load_config(None, ["server.optimizer=fedadagrad", "server.beta1=0.5"])  # forwarded, not ignored
    assert cfg.server.optimizer_kwargs() == {"tau": 1e-3, "beta1": 0.5}
    cfg = load_config(None, ["server.optimizer=fedadam", "server.beta1=0.0"])
    assert cfg.server.optimizer_kwargs()["beta1"] == 0.0


@pytest.mark.parametrize("overrides", [
    ["server.optimizer=fedadam", "server.beta1=1.5"],
    ["server.optimizer=fedyogi", "server.beta2=1.0"],
    ["server.optimizer=fedyogi", "server.tau=0.0"],
    ["server.optimizer=fedavgm", "server.momentum=2.0"],
])
def test_server_hyperparameters_validated_at_load(overrides):
    _err(overrides)


def test_unknown_zoo_model_rejected_at_load():
    assert "zoo:nope" in _err(["model.name=zoo:nope"]) or "nope" in _err(["model.name=zoo:nope"])


def test_unknown_dataset_rejected_at_load():
    assert "data.dataset" in _err(["data.dataset=nope"])


@pytest.mark.parametrize("overrides, needle", [
    # the case: DP parameters without privacy.mode run without privacy, and said nothing
    (["privacy.clip=1.0", "privacy.noise_multiplier=1.0", "privacy.delta=1e-5"],
     "privacy.clip = 1.0, privacy.noise_multiplier = 1.0 do nothing while privacy.mode = 'off': set privacy.mode = "
     "'central' or 'distributed' (client-level DP) for it to take effect, or remove them"),
    (["privacy.local_noise_multiplier=1.0"], "privacy.local_noise_multiplier = 1.0 does nothing while privacy.local "
     "= 'off': set privacy.local = 'dpsgd'"),
    (["privacy.delta=1e-6"], "privacy.delta = 1e-06 does nothing while privacy.mode and privacy.local are off"),
    (["privacy.secagg_threshold=0.6"], "privacy.secagg_threshold = 0.6 does nothing while "
     "privacy.secure_aggregation = false"),
    (['data.hf_text="x"'], "data.hf_text = 'x' does nothing while data.dataset = 'fortunes' is no hf: data set"),
    (["grab.kp=3.0"], "grab.kp = 3.0 does nothing while grab.enabled = false: write [switch.grab]"),
])
def test_a_setting_that_does_nothing_is_refused(overrides, needle):
    """A value the rest of the config makes inert is an error naming it and what would make it
    take effect (issue 49), through `fedsplice validate`'s load as through a run's."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)


def test_inert_checks_let_active_and_saved_settings_through(tmp_path):
    """The same values where they take effect load; a run's saved config.toml, which writes every
    default, reads back (fields count as set only where they differ from the default)."""
    cfg = load_config(None, ["privacy.mode=central", "privacy.clip=1.0", "privacy.noise_multiplier=1.0",
                             "privacy.delta=1e-6"])
    assert (cfg.privacy.clip, cfg.privacy.delta) == (1.0, 1e-6)
    assert load_config(None, ["privacy.local=dpsgd", "privacy.local_noise_multiplier=1.0"]).privacy.local == "dpsgd"
    assert load_config(None, ["grab.enabled=true", "grab.kp=3.0"]).switch == {"grab": {"kp": 3.0}}
    saved = tmp_path / "config.toml"
    write_config(tmp_path, load_config(None, []))
    assert to_dict(load_config(saved)) == to_dict(load_config(None, []))
