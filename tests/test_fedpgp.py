"""FedPGP (algorithms/fedpgp.py): the prompt-wise contrastive loss against hand values, the
low-rank prompt correction, the split (only the global prompt travels), the objective, an
end-to-end tiny run and bad parameters."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsplice.algorithms.fedpgp import views
from fedsplice.core import wire
from fedsplice.core.context import TrainContext
from fedsplice.core.losses import prompt_contrastive
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.model.taskmodel import TaskModel
from fedsplice.runtimes.inprocess import run_rounds

CLASSES = ["sports", "science", "music"]
PGP = dict(algorithm='"fedpgp"', peft__type='"prompt"', method="{rank = 2}")


def test_contrastive_loss_matches_hand_values():
    # per class: pos = cos(template, global), neg = cos(global, personal); mean softplus((neg − pos)/τ)
    zc = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    zg = torch.tensor([[0.8, 0.6], [0.0, 1.0]])
    zp = torch.tensor([[0.6, 0.8], [1.0, 0.0]])
    # class 0: pos 0.8, neg 0.96 -> log(1 + e^0.32) = 0.8658929; class 1: pos 1, neg 0 -> log(1 + e^-2)
    want = (np.log1p(np.exp(0.32)) + np.log1p(np.exp(-2.0))) / 2
    assert want == pytest.approx(0.4964105, abs=1e-7)
    assert float(prompt_contrastive(zc, zg, zp, 0.5)) == pytest.approx(want, abs=1e-6)
    # features are normalized first: scaled rows give the same loss
    got = prompt_contrastive(zc * torch.tensor([[3.0], [2.0]]), zg * 5, zp * torch.tensor([[5.0], [7.0]]), 0.5)
    assert float(got) == pytest.approx(want, abs=1e-6)


def test_lowrank_prompt_views(tiny_cfg):
    cfg = tiny_cfg(**PGP)
    m = TaskModel(cfg, CLASSES)
    m.eval()
    n, d = m.prompt.ctx.shape
    assert m.prompt_lowrank.U.shape == (n, 2) and m.prompt_lowrank.V.shape == (2, d)
    assert 0.01 < float(m.prompt_lowrank.U.detach().std()) < 0.03  # ~ N(0, 0.02²)
    with torch.no_grad():
        v = views(m)
        assert torch.allclose(v["personal"], m.class_embeddings())  # the client's prompt is p_G + U·V
        with m.zero_shot():
            assert torch.allclose(v["template"], m.class_embeddings())  # the hand-crafted class prompt
        m.prompt_lowrank.U.zero_()  # U·V = 0: the personal view is the global prompt's
        v0 = views(m)
        assert torch.allclose(v0["personal"], v0["global"]) and torch.allclose(v0["global"], v["global"])
        assert not torch.allclose(v["personal"], v["global"])


def test_split_objective_and_what_travels(tiny_cfg, capture_uploads):
    exp = build(tiny_cfg(**PGP, server__rounds=2))
    assert exp.global_names == ["prompt.ctx"]
    assert exp.private_names == ["prompt_lowrank.U", "prompt_lowrank.V"]
    # the objective: CE on the personalized prompt's logits + μ·L_con of the three views
    texts, y = ["a goal in the last minute", "the cell divides"], torch.tensor([0, 1])
    out = exp.recipe.objective(exp.model, texts, y, np.arange(2), TrainContext())
    with torch.no_grad():
        v = views(exp.model)
        ce = F.cross_entropy(exp.model(texts, v["personal"]), y)
        con = 0.5 * prompt_contrastive(v["template"], v["global"], v["personal"], 0.5)
    assert float(out["task"].detach()) == pytest.approx(float(ce), abs=1e-5)
    assert float(out["contrastive"].detach()) == pytest.approx(float(con), abs=1e-5)
    store = MemoryStore()
    final = run_rounds(exp, store, lambda r: None)
    assert capture_uploads and all(sorted(wire.decode(b)) == ["prompt.ctx"] for _, _, b in capture_uploads)
    trained = {cid for _, cid, _ in capture_uploads}
    for cid in trained:  # U and V stay on the client, trained
        st = store.get(cid)
        u = st["param/prompt_lowrank.U"]
        assert not torch.equal(u, exp.init_params["prompt_lowrank.U"])
    assert not torch.equal(final["global_params"]["prompt.ctx"], exp.init_params["prompt.ctx"])


@pytest.mark.parametrize("sets,match", [
    (["method.mu=-1"], "method.mu must be >= 0"),
    (["method.tau=0"], "method.tau must be > 0"),
    (["method.rank=0"], "method.rank must be >= 1"),
    (["peft.type=\"lora\""], "algorithm 'fedpgp' adds a private low-rank correction to a prompt: set peft.type"),
    # a moved setting of another method: the one line names where it went
    (["peft.private_r=4"], "peft.private_r = 4 is now `private_r` in the [method] table of algorithm 'pfedlora'"),
])
def test_bad_parameters_exit_2_with_one_line(sets, match, tiny_cfg, cli_refuses):
    cli_refuses(tiny_cfg(**PGP), sets, match)
