"""FedOTP (algorithms/fedotp.py): the partial-OT plan against hand-solved cases and POT, the OT
head's scores and gradient path, the split (only the global prompt travels), an end-to-end tiny
run and bad parameters."""

import dataclasses
import math

import numpy as np
import ot
import pytest
import torch

from fedsplice.core import wire
from fedsplice.core.ot import ot_scores, partial_plan
from fedsplice.errors import ConfigError
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.model.taskmodel import TaskModel
from fedsplice.runtimes.inprocess import run_rounds

CLASSES = ["sports", "science", "music"]
OTP = dict(algorithm='"fedotp"', peft__type='"prompt"', method="{gamma = 0.8}")


def test_plan_hand_solved_case():
    # cos [[.5, .1], [.1, .5]] (tokens × prompts), ε 0.1, γ 0.8: no token reaches its cap 1/2, so
    # each prompt's mass 0.4 is a softmax over tokens of cos/ε: T = 0.4·[[s, 1−s], [1−s, s]], s = 1/(1+e⁻⁴)
    sim = torch.tensor([[[0.5, 0.1], [0.1, 0.5]]])
    t = partial_plan(1 - sim, torch.full((1, 2), 0.5), 0.8, 0.1)
    s = 1 / (1 + math.exp(-4))
    assert torch.allclose(t[0], 0.4 * torch.tensor([[s, 1 - s], [1 - s, s]]), atol=1e-6)
    # the cap binds (cos [[.9, .1], [.1, .2]]): token 0 is saturated at 1/2; the official loop's
    # plan after its stopping rule (mean |Δv| < 1e-3, 48 iterations), from a port of its code
    t = partial_plan(1 - torch.tensor([[[0.9, 0.1], [0.1, 0.2]]]), torch.full((1, 2), 0.5), 0.8, 0.1)
    want = torch.tensor([[0.399852, 0.100151], [0.000148, 0.299849]])
    assert torch.allclose(t[0], want, atol=2e-6)
    assert t[0].sum(1)[0] == pytest.approx(0.5, abs=1e-5) and torch.allclose(t[0].sum(0), torch.tensor([0.4, 0.4]))


@pytest.mark.parametrize("seed", range(4))
def test_plan_equals_pot_partial_wasserstein(seed):
    """Run to convergence, the batched solver gives POT's entropic partial plan; padding tokens
    (capacity 0) take no mass and change nothing."""
    g = np.random.default_rng(seed)
    m, n, gamma, eps = 5, 2, 0.8, 0.1
    cost = g.uniform(0.3, 1.2, size=(m, n))
    want = ot.partial.entropic_partial_wasserstein(np.full(m, 1 / m), np.full(n, gamma / n), cost, reg=eps,
                                                   m=gamma, numItermax=10000, stopThr=1e-14)
    padded = np.vstack([cost, g.uniform(0, 2, size=(2, n))])
    cap = torch.tensor([[1 / m] * m + [0.0, 0.0]], dtype=torch.float64)
    got = partial_plan(torch.tensor(padded)[None], cap, gamma, eps, iters=10000, thresh=1e-14)[0]
    assert np.allclose(got[:m].numpy(), want, atol=1e-8)
    assert float(got[m:].abs().sum()) == 0.0


def test_scores_weight_cosines_by_a_constant_plan():
    g = torch.Generator().manual_seed(0)
    tok = torch.nn.functional.normalize(torch.randn(2, 4, 3, generator=g), dim=-1)
    mask = torch.tensor([[True] * 4, [True, True, True, False]])
    prompts = torch.nn.functional.normalize(torch.randn(2, 5, 3, generator=g), dim=-1).requires_grad_()
    s = ot_scores(tok, mask, prompts, 0.8, 0.1)
    sim = torch.einsum("bmd,nkd->bkmn", tok, prompts.detach())
    cap = (mask.double() / mask.sum(1, keepdim=True)).unsqueeze(1).expand(2, 5, 4).reshape(10, 4)
    plan = partial_plan((1 - sim).reshape(10, 4, 2), cap, 0.8, 0.1).reshape(2, 5, 4, 2)
    assert torch.allclose(s, (plan * sim).sum((-2, -1)), atol=1e-6)
    assert float(plan[1, :, 3].abs().sum()) == 0.0  # the padding token
    s.sum().backward()  # d/d prompt_{n,k} = Σ_b Σ_m T_bkmn·token_bm: the plan is a constant
    assert torch.allclose(prompts.grad, torch.einsum("bkmn,bmd->nkd", plan, tok), atol=1e-6)


def test_model_ot_head(tiny_cfg):
    m = TaskModel(tiny_cfg(**OTP), CLASSES)
    m.eval()
    texts = ["a goal in the last minute", "the cell divides", "a new album"]
    with torch.no_grad():
        ce = m.class_embeddings()
        assert ce.shape[:2] == (2, 3)  # the global prompt's class features, then the local one's
        tokens, mask = m._inputs.tokens(texts)
        want = m.mcfg.logit_scale * ot_scores(tokens, mask, ce, 0.8, 0.1)
        assert torch.allclose(m(texts), want, atol=1e-5)
        # the official stopping rule is batch-wide (mean |Δv| over every problem of the batch), so a
        # score depends a little on its batch: the same batch gives the same scores
        assert torch.allclose(m.predict(texts, 3), want, atol=1e-5)
        assert torch.allclose(m.predict(texts, 2), want, atol=1e-2)
        with m.zero_shot():  # the frozen model scores pooled features against the template prompts
            zs = m.predict(texts, 8)
    ref = TaskModel(tiny_cfg(algorithm='"promptfl"', peft__type='"prompt"'), CLASSES)
    with torch.no_grad(), ref.zero_shot():
        assert torch.allclose(zs, ref.predict(texts, 8), atol=1e-5)


def test_split_and_what_travels(tiny_cfg, capture_uploads):
    exp = build(tiny_cfg(**OTP, server__rounds=2))
    assert exp.global_names == ["prompt.ctx"] and exp.private_names == ["prompt_ot.ctx"]
    store = MemoryStore()
    records = []
    final = run_rounds(exp, store, records.append)
    assert capture_uploads and all(sorted(wire.decode(b)) == ["prompt.ctx"] for _, _, b in capture_uploads)
    for cid in {c for _, c, _ in capture_uploads}:  # the local prompt stays on the client, trained
        assert not torch.equal(store.get(cid)["param/prompt_ot.ctx"], exp.init_params["prompt_ot.ctx"])
    assert not torch.equal(final["global_params"]["prompt.ctx"], exp.init_params["prompt.ctx"])
    # GM, recomputed by hand: the final global prompt with a fresh local prompt on the global test set
    d = exp.data
    exp.model.load_params({**final["global_params"], "prompt_ot.ctx": exp.init_params["prompt_ot.ctx"]})
    pred = exp.model.predict(d.test_texts[:d.global_test_size], 8).argmax(1).numpy()
    assert records[-1]["gm"]["accuracy"] == pytest.approx(float((pred == d.test_labels[:d.global_test_size]).mean()))


@pytest.mark.parametrize("sets,match", [
    (["method.gamma=1.5"], "method.gamma = 1.5: the mass in"),
    (["method.eps=0"], "method.eps must be > 0"),
    (["method.gamma=0"], "method.gamma = 0.0"),
    (["peft.type=\"lora\""], "set peft.type = 'prompt'"),
    (["model.task=\"encoder_head\""], "set model.task = 'dual_encoder'"),
    # a moved setting of another method: the one line names where it went
    (["peft.portfolio=0.2"], "peft.portfolio = 0.2 is now `theta` in the [method] table of algorithm 'promptfolio', "
                             "and this config runs algorithm 'fedotp'"),
])
def test_bad_parameters_exit_2_with_one_line(sets, match, tiny_cfg, cli_refuses):
    cli_refuses(tiny_cfg(**OTP), sets, match)


def test_clip_matches_image_patches(tmp_path):
    """On CLIP the local features are an image's projected patch tokens (the class token dropped)."""
    import numpy as np

    from fedsplice.config import DataConfig, ExperimentConfig, ModelConfig, PeftConfig
    from fedsplice.data import zoo
    from fedsplice.data.samples import Sample

    clip_dir = str(zoo.tiny_clip(tmp_path / "clip"))
    cfg = ExperimentConfig(algorithm="fedotp", model=ModelConfig(name=clip_dir, logit_scale=100.0),
                           peft=PeftConfig(type="prompt"), data=DataConfig(class_prompt="a photo of a {label}."))
    cfg.check()
    m = TaskModel(cfg, ["circle", "square", "triangle"])
    m.eval()
    g = np.random.default_rng(0)
    items = [Sample(f"toy/{i}", g.integers(0, 256, (20, 24, 3), dtype=np.uint8), None) for i in range(3)]
    with torch.no_grad():
        vm, clip = m._text.hf.vision_model, m._text.hf
        from fedsplice.model.vision import pixel_values
        h = vm(pixel_values=pixel_values(m.image_processor, items, vm)).last_hidden_state
        tok = torch.nn.functional.normalize(clip.visual_projection(vm.post_layernorm(h[:, 1:])), dim=-1)
        want = 100.0 * ot_scores(tok, torch.ones(tok.shape[:2], dtype=torch.bool), m.class_embeddings(), 0.8, 0.1)
        assert torch.allclose(m(items), want, atol=1e-4)
    with pytest.raises(Exception, match="needs an image and no caption"):
        m([Sample("toy/x", items[0].image, "a caption")])


@pytest.mark.parametrize("iters,thresh,stops", [(100, 1e-3, 55), (100, 1e-4, 83), (7, 1e-3, 7)])
def test_reading_the_stopping_test_every_few_iterations_gives_the_same_plan(iters, thresh, stops):
    """On an accelerator the test is read every 10 iterations; the plan is still the one of the
    first iteration that met it (55 and 83 here: mid-chunk), or of the last allowed, bit for bit."""
    g = torch.Generator().manual_seed(3)
    cost = torch.rand(6, 5, 4, generator=g)
    cap = torch.full((6, 5), 0.2)
    ref = partial_plan(cost, cap, 0.8, 0.1, iters=iters, thresh=thresh, chunk=1)
    assert torch.equal(partial_plan(cost, cap, 0.8, 0.1, iters=stops, thresh=0.0, chunk=1), ref)
    assert not torch.equal(partial_plan(cost, cap, 0.8, 0.1, iters=stops - 1, thresh=0.0, chunk=1), ref)
    for chunk in (3, 10, 1000):
        assert torch.equal(partial_plan(cost, cap, 0.8, 0.1, iters=iters, thresh=thresh, chunk=chunk), ref), chunk


# ----------------------------------------------------------------------------- a method's own prompt parts


def test_a_users_method_adds_prompt_modules_without_editing_fedsplice(tiny_cfg):
    """PromptParts, the mechanism FedOTP uses: a method registered here adds a second prompt
    ("mine"), composes the class side from both and keeps "mine" PRIVATE; nothing in fedsplice
    names it. The model registers the module, the split sees its kind, a run trains both."""
    import torch.nn.functional as F

    from fedsplice.algorithms import NoParams, PromptParts, Recipe, register_algorithm
    from fedsplice.algorithms import registry as R
    from fedsplice.core import split as S

    parts = PromptParts(modules=lambda make, prompt, gen: {"mine": make()},
                        class_embeddings=lambda enc, m: F.normalize(enc(m["prompt"]) + enc(m["mine"]), dim=-1))
    register_algorithm("twoprompt", NoParams, lambda p, spec: Recipe(
        {n: S.PRIVATE if i.kind == "mine" else S.GLOBAL for n, i in spec.infos.items()}), prompt_parts=lambda p: parts)
    try:
        exp = build(tiny_cfg(algorithm='"twoprompt"', peft__type='"prompt"', server__rounds=2))
        assert exp.global_names == ["prompt.ctx"] and exp.private_names == ["mine.ctx"]
        m = exp.model
        with torch.no_grad():
            want = F.normalize(m._classes.from_prompt(m.prompt) + m._classes.from_prompt(m.mine), dim=-1)
            assert torch.allclose(m.class_embeddings(), want, atol=1e-6)
        store = MemoryStore()
        final = run_rounds(exp, store, lambda r: None)
        assert not torch.equal(final["global_params"]["prompt.ctx"], exp.init_params["prompt.ctx"])
        mine = [store.get(c)["param/mine.ctx"] for c in store.clients()]
        assert mine and any(not torch.equal(t, exp.init_params["mine.ctx"]) for t in mine)
        # a module name the model already uses is refused in one line
        clash = dataclasses.replace(parts, modules=lambda make, prompt, gen: {"adapter": make()})
        R.ALGORITHMS["twoprompt"] = dataclasses.replace(R.ALGORITHMS["twoprompt"], prompt_parts=lambda p: clash)
        with pytest.raises(ConfigError, match="PromptParts.modules names 'adapter', an attribute the model already"):
            TaskModel(tiny_cfg(algorithm='"twoprompt"', peft__type='"prompt"'), CLASSES)
    finally:
        R.ALGORITHMS.pop("twoprompt")


def test_a_run_saved_before_the_move_reads_with_its_settings_in_method(tmp_path):
    """FedOTP's settings moved from [peft] into its [method] table: a saved run's config (or an old
    file) reads as the current one (results records and checkpoints stay reusable); other methods
    drop them where they were off."""
    from fedsplice.config import load_config, saved_as_current

    (tmp_path / "old.toml").write_text('algorithm = "fedotp"\n[peft]\ntype = "prompt"\not_gamma = 0.5\n')
    assert load_config(tmp_path / "old.toml").method == {"gamma": 0.5}

    old = {"algorithm": "fedotp", "method": {}, "peft": {"type": "prompt", "ot_gamma": 0.8, "ot_eps": 0.1,
                                                         "ot_iters": 100}}
    got = saved_as_current(old)
    assert got["method"] == {"gamma": 0.8, "eps": 0.1, "iters": 100} and "ot_gamma" not in got["peft"]
    assert old["peft"]["ot_gamma"] == 0.8  # the caller's table is left as it was
    other = saved_as_current({"algorithm": "promptfl", "peft": {"type": "prompt", "ot_gamma": 0.0, "ot_eps": 0.1,
                                                                 "ot_iters": 100, "prompt_lowrank": 0}})
    assert other["method"] == {} and "ot_eps" not in other["peft"] and "prompt_lowrank" not in other["peft"]
    pgp = saved_as_current({"algorithm": "fedpgp", "method": {"mu": 0.5}, "peft": {"prompt_lowrank": 8}})
    assert pgp["method"] == {"mu": 0.5, "rank": 8}


def test_every_prompt_method_owns_its_modules_and_settings():
    """FedOTP, FedPGP and PromptFolio declare their prompt parts; [peft] has none of their
    settings, and the model's code names none of their modules (tests/test_layout.py scans for
    method names; this checks the module names the scan cannot know)."""
    import inspect

    from fedsplice.algorithms import get_algorithm
    from fedsplice.config import PeftConfig
    from fedsplice.model import encoders, peft, scorers, taskmodel

    kinds = {"fedotp": "prompt_ot", "fedpgp": "prompt_lowrank", "promptfolio": "prompt_local"}
    assert all(get_algorithm(a).prompt_parts is not None for a in kinds)
    fields = {f.name for f in dataclasses.fields(PeftConfig)}
    assert not fields & {"ot_gamma", "ot_eps", "ot_iters", "prompt_lowrank", "portfolio"}
    code = "".join(inspect.getsource(m) for m in (encoders, peft, scorers, taskmodel))
    assert [k for k in kinds.values() if k in code] == []
