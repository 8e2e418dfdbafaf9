"""Split policies on the parameter names of a real (tiny) BERT TaskModel."""

import pytest

from fedsplice.algorithms import ModelSpec, build_recipe
from fedsplice.core import split as S
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


LAYER = "backbone.base_model.model.encoder.layer"  # the tiny BERT's 2 layers, under HF peft
HEAD = ["head.bias", "head.weight"]


def lora(roles: str = "qkvo", factors: str = "AB") -> list[str]:
    """The exact LoRA parameter names of the tiny BERT, written out from its module paths."""
    return sorted(f"{LAYER}.{layer}.{BERT_ROLE[r]}.lora_{f}.default.weight"
                  for layer in (0, 1) for r in roles for f in factors)


def _check_coverage(split, trainable):
    assert sorted(split) == sorted(trainable)  # every trainable name exactly once (dict keys)
    assert set(split.values()) <= {S.GLOBAL, S.PRIVATE}
    S.validate(split, list(trainable))


def _groups(split) -> tuple[list[str], list[str]]:
    return S.names_in(split, S.GLOBAL), S.names_in(split, S.PRIVATE)


@pytest.mark.parametrize("task", ["dual_encoder", "encoder_head"])
def test_param_infos_read_roles_factors_layers(models, task):
    m = models[task]
    infos = m.param_infos()
    heads = HEAD if task == "encoder_head" else []
    assert sorted(infos) == sorted(m.trainable()) == sorted(lora() + heads)
    for n in lora():
        i = infos[n]
        assert i.kind == "lora"
        assert f".{BERT_ROLE[i.role]}.lora_{i.factor}." in n
        assert i.layer in (f"{LAYER}.0", f"{LAYER}.1") and n.startswith(i.layer + ".")
    assert sorted(n for n in infos if infos[n].kind == "head") == heads
    assert all(infos[n].role is None and infos[n].factor is None for n in heads)


@pytest.mark.parametrize("task", ["dual_encoder", "encoder_head"])
def test_all_and_none_global(models, task):
    infos = models[task].param_infos()
    trainable = list(models[task].trainable())
    every = sorted(lora() + (HEAD if task == "encoder_head" else []))
    split = S.all_global(infos)
    _check_coverage(split, trainable)
    assert _groups(split) == (every, [])
    split = S.none_global(infos)
    _check_coverage(split, trainable)
    assert _groups(split) == ([], every)


@pytest.mark.parametrize("task", ["dual_encoder", "encoder_head"])
def test_by_roles_qk(models, task):
    m = models[task]
    split = S.by_roles(m.param_infos(), {"q", "k"})
    _check_coverage(split, list(m.trainable()))
    heads = HEAD if task == "encoder_head" else []  # not LoRA of a role: shared
    assert _groups(split) == (sorted(lora("qk") + heads), lora("vo"))


def test_by_roles_single_role(models):
    split = S.by_roles(models["dual_encoder"].param_infos(), ["v"])
    assert _groups(split) == (lora("v"), lora("qko"))


@pytest.mark.parametrize("task", ["dual_encoder", "encoder_head"])
def test_by_lora_factor(models, task):
    m = models[task]
    split = S.by_lora_factor(m.param_infos())
    _check_coverage(split, list(m.trainable()))
    heads = HEAD if task == "encoder_head" else []
    assert _groups(split) == (sorted(lora(factors="A") + heads), lora(factors="B"))


def test_head_private(models):
    m = models["encoder_head"]
    split = S.head_private(m.param_infos())
    _check_coverage(split, list(m.trainable()))
    assert _groups(split) == (lora(), HEAD)
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
    return build_recipe(cfg, ModelSpec(m.param_infos(), {n: p.shape for n, p in params.items()}, m.scalings()))


def test_pfadapter_shares_exactly_half_of_lora(models, cfg_factory, tiny_bert_dir, toy_jsonl):
    m = models["dual_encoder"]
    params = m.trainable()
    r = _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, m)  # roles q,k,v,o; global q,k
    g, p = _groups(r.split)
    assert (g, p) == (lora("qk"), lora("vo"))
    assert sum(params[n].numel() for n in g) == sum(params[n].numel() for n in p)
    assert len(r.loss_terms) == 1 and r.loss_terms[0].weight == pytest.approx(0.1)


def test_pfadapter_ablations(models, cfg_factory, tiny_bert_dir, toy_jsonl):
    m = models["dual_encoder"]
    no_sel = _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, m, method__selective_aggregation="false")
    assert _groups(no_sel.split) == (lora(), [])
    assert len(no_sel.loss_terms) == 1  # λo kept
    no_ortho = _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, m, method__ortho_lambda="0.0")
    assert no_ortho.loss_terms == [] and _groups(no_ortho.split) == (lora("qk"), lora("vo"))
    q_only = _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, m, method__global_roles='["q"]')
    assert _groups(q_only.split) == (lora("q"), lora("kvo"))


@pytest.mark.parametrize("algo,global_,private", [
    ("lora", lora(), []), ("local", [], lora()), ("fedsa-lora", lora(factors="A"), lora(factors="B")),
    ("fedprox", lora(), [])])
def test_recipes_of_other_algorithms(models, cfg_factory, tiny_bert_dir, toy_jsonl, algo, global_, private):
    m = models["dual_encoder"]
    r = _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, m, algorithm=f'"{algo}"')
    assert _groups(r.split) == (global_, private)
    assert len(r.loss_terms) == (1 if algo == "fedprox" else 0)


def test_fedper_needs_a_head(models, cfg_factory, tiny_bert_dir, toy_jsonl):
    with pytest.raises(ConfigError, match="model.task"):
        _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, models["dual_encoder"], algorithm='"fedper"')
    r = _recipe(cfg_factory, tiny_bert_dir, toy_jsonl, models["encoder_head"], algorithm='"fedper"',
                model__task='"encoder_head"')
    assert _groups(r.split) == (lora(), HEAD)
