"""Split policies on the parameter names of a real (tiny) BERT TaskModel."""

import pytest

from fedsplice.core import split as S
from fedsplice.algorithms.registry import build_recipe
from fedsplice.errors import ConfigError

BERT_ROLE = {"q": "attention.self.query", "k": "attention.self.key",
             "v": "attention.self.value", "o": "attention.output.dense"}
CLASSES = ["sports", "science", "music"]


@pytest.fixture(scope="module")
def models(cfg_factory, tiny_bert_dir, toy_jsonl):
    from fedsplice.model.taskmodel import TaskModel

    out = {}
    for task in ("dual_encoder", "encoder_head"):
        cfg = cfg_factory(tiny_bert_dir, toy_jsonl, model__task=f'"{task}"')
        out[task] = TaskModel(cfg, CLASSES)
    return out


def _check_coverage(split, trainable):
    assert sorted(split) == sorted(trainable)  # every trainable name exactly once (dict keys)
    assert set(split.values()) <= {S.GLOBAL, S.PRIVATE}
    S.validate(split, list(trainable))


def _lora_names(trainable, role=None, factor=None):
    out = [n for n in trainable if ".lora_A." in n or ".lora_B." in n]
    if role:
        out = [n for n in out if f".{BERT_ROLE[role]}.lora_" in n]
    if factor:
        out = [n for n in out if f".lora_{factor}." in n]
    return sorted(out)


@pytest.mark.parametrize("task", ["dual_encoder", "encoder_head"])
def test_param_infos_read_roles_factors_layers(models, task):
    m = models[task]
    infos = m.param_infos()
    lora = _lora_names(infos)
    assert len(lora) == 2 * 4 * 2  # layers × roles × factors
    for n in lora:
        i = infos[n]
        assert i.kind == "lora"
        assert f".{BERT_ROLE[i.role]}.lora_{i.factor}." in n
        assert i.layer.endswith((".layer.0", ".layer.1")) and n.startswith(i.layer + ".")
    heads = sorted(n for n in infos if infos[n].kind == "head")
    assert heads == (["head.bias", "head.weight"] if task == "encoder_head" else [])
    assert all(infos[n].role is None and infos[n].factor is None for n in heads)


@pytest.mark.parametrize("task", ["dual_encoder", "encoder_head"])
def test_all_and_none_global(models, task):
    infos = models[task].param_infos()
    trainable = list(models[task].trainable())
    for policy, group in ((S.all_global, S.GLOBAL), (S.none_global, S.PRIVATE)):
        split = policy(infos)
        _check_coverage(split, trainable)
        assert S.names_in(split, group) == sorted(trainable)
        other = S.PRIVATE if group == S.GLOBAL else S.GLOBAL
        assert S.names_in(split, other) == []


@pytest.mark.parametrize("task", ["dual_encoder", "encoder_head"])
def test_by_roles_qk(models, task):
    m = models[task]
    infos, trainable = m.param_infos(), list(m.trainable())
    split = S.by_roles(infos, {"q", "k"})
    _check_coverage(split, trainable)
    g, p = S.names_in(split, S.GLOBAL), S.names_in(split, S.PRIVATE)
    heads = ["head.bias", "head.weight"] if task == "encoder_head" else []
    assert g == sorted(_lora_names(trainable, "q") + _lora_names(trainable, "k") + heads)
    assert p == sorted(_lora_names(trainable, "v") + _lora_names(trainable, "o"))
    assert all("attention.self.query" in n or "attention.self.key" in n for n in g if n not in heads)
    assert all("attention.self.value" in n or "attention.output.dense" in n for n in p)
    assert len(p) == 8


def test_by_roles_single_role(models):
    trainable = list(models["dual_encoder"].trainable())
    split = S.by_roles(models["dual_encoder"].param_infos(), ["v"])
    assert S.names_in(split, S.GLOBAL) == _lora_names(trainable, "v")
    assert len(S.names_in(split, S.PRIVATE)) == 12


@pytest.mark.parametrize("task", ["dual_encoder", "encoder_head"])
def test_by_lora_factor(models, task):
    m = models[task]
    trainable = list(m.trainable())
    split = S.by_lora_factor(m.param_infos())
    _check_coverage(split, trainable)
    heads = ["head.bias", "head.weight"] if task == "encoder_head" else []
    assert S.names_in(split, S.GLOBAL) == sorted(_lora_names(trainable, factor="A") + heads)
    assert S.names_in(split, S.PRIVATE) == _lora_names(trainable, factor="B")
    assert len(_lora_names(trainable, factor="B")) == 8


def test_head_private(models):
    m = models["encoder_head"]
    trainable = list(m.trainable())
    split = S.head_private(m.param_infos())
    _check_coverage(split, trainable)
    assert S.names_in(split, S.PRIVATE) == ["head.bias", "head.weight"]
    assert S.names_in(split, S.GLOBAL) == _lora_names(trainable)
    with pytest.raises(ConfigError, match="model.task"):
        S.head_private(models["dual_encoder"].param_infos())


def test_validate_rejects_bad_splits(models):
    m = models["encoder_head"]
    trainable = list(m.trainable())
    good = S.all_global(m.param_infos())
    S.validate(good, trainable)

    missing = dict(good)
    del missing["head.weight"]
    with pytest.raises(ConfigError, match="ungrouped.*head.weight"):
        S.validate(missing, trainable)

    extra = {**good, "backbone.embeddings.word_embeddings.weight": S.GLOBAL}
    with pytest.raises(ConfigError, match="word_embeddings.*not a trainable"):
        S.validate(extra, trainable)

    bad = {**good, "head.bias": "shared"}
    with pytest.raises(ConfigError, match="head.bias.*'shared'"):
        S.validate(bad, trainable)


# ----------------------------------------------------------------------------- recipes


def _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, m, **kw):
    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, **kw)
    params = m.trainable()
    return build_recipe(cfg, m.param_infos(), {n: p.shape for n, p in params.items()}, m.scalings())


def test_pfadapter_shares_exactly_half_of_lora(models, cfg_factory, tiny_bert_dir, toy_jsonl):
    m = models["dual_encoder"]
    params = m.trainable()
    r = _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, m)  # roles q,k,v,o; global q,k
    g, p = S.names_in(r.split, S.GLOBAL), S.names_in(r.split, S.PRIVATE)
    assert len(g) == len(p) == len(params) // 2 == 8
    assert sum(params[n].numel() for n in g) == sum(params[n].numel() for n in p)
    assert len(r.loss_terms) == 1 and r.loss_terms[0].weight == pytest.approx(0.1)


def test_pfadapter_ablations(models, cfg_factory, tiny_bert_dir, toy_jsonl):
    m = models["dual_encoder"]
    n = len(m.trainable())
    no_sel = _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, m, method__selective_aggregation="false")
    assert S.names_in(no_sel.split, S.PRIVATE) == [] and len(S.names_in(no_sel.split, S.GLOBAL)) == n
    assert len(no_sel.loss_terms) == 1  # λo kept
    no_ortho = _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, m, method__ortho_lambda="0.0")
    assert no_ortho.loss_terms == [] and len(S.names_in(no_ortho.split, S.PRIVATE)) == n // 2
    q_only = _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, m, method__global_roles='["q"]')
    assert len(S.names_in(q_only.split, S.GLOBAL)) == n // 4


@pytest.mark.parametrize("algo,n_global,n_private", [
    ("lora", 16, 0), ("local", 0, 16), ("fedsa-lora", 8, 8), ("fedprox", 16, 0)])
def test_recipes_of_other_algorithms(models, cfg_factory, tiny_bert_dir, toy_jsonl, algo, n_global, n_private):
    m = models["dual_encoder"]
    r = _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, m, algorithm=f'"{algo}"')
    assert (len(S.names_in(r.split, S.GLOBAL)), len(S.names_in(r.split, S.PRIVATE))) == (n_global, n_private)
    assert len(r.loss_terms) == (1 if algo == "fedprox" else 0)


def test_fedper_needs_a_head(models, cfg_factory, tiny_bert_dir, toy_jsonl):
    with pytest.raises(ConfigError, match="model.task"):
        _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, models["dual_encoder"], algorithm='"fedper"')
    r = _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, models["encoder_head"], algorithm='"fedper"',
                model__task='"encoder_head"')
    assert S.names_in(r.split, S.PRIVATE) == ["head.bias", "head.weight"]
