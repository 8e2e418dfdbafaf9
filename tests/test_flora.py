"""FLoRA (algorithms/flora.py): the dense base ΔW in the forward against a hand-computed layer,
stacking equal to the merged upload's FedAvg on hand-made adapters, and a tiny run: each client
trains a fresh LoRA of its own rank, the dense base never trains locally, and the server's new
base is ΔW + Σ_k p_k s B_k A_k exactly; bad parameters."""

import pytest
import torch

from fedsplice.algorithms import flora as F
from fedsplice.core import wire
from fedsplice.core.server import weighted_mean
from fedsplice.errors import ConfigError
from fedsplice.federation import tasks
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.model import peft as P
from fedsplice.runtimes.inprocess import run_rounds

FL = dict(algorithm='"flora"', method="{ranks = [4, 1, 2]}")  # tiny peft.r = 4


def test_dense_base_adds_to_the_frozen_weight_exactly():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False))
    model = get_peft_model(base, LoraConfig(r=1, target_modules=["0"]))
    P.add_beside(model, {"dense": F.DENSE_BASE})
    lin = model.base_model.model[0]
    with torch.no_grad():
        lin.lora_dense.copy_(torch.tensor([[1.0, 0.0, -1.0], [2.0, 1.0, 0.0]]))
    x = torch.tensor([[1.0, 2.0, 3.0]])
    w0 = lin.base_layer.weight.detach()
    assert torch.allclose(model(x), x @ (w0 + lin.lora_dense.detach()).T, atol=1e-6)  # B = 0: LoRA adds nothing
    with model.disable_adapter():
        assert torch.allclose(model(x), x @ w0.T, atol=1e-6)  # zero-shot: the frozen weight alone
    names = [n for n, _ in model.named_parameters() if n.endswith(".lora_dense")]
    assert P.param_infos(names, {"q": "0"})[names[0]].kind == "lora_dense"
    with pytest.raises(ConfigError, match="LoraParts.beside names 'A'"):  # peft's own lora_A
        P.add_beside(model, {"A": F.DENSE_BASE})


def test_merged_upload_fedavg_is_the_stacked_product():
    """FedAvg (weights n_k) of ΔW + s B_k A_k = ΔW + s·B_st A_st with A_st = [p_k A_k], B_st = [B_k]."""
    g = torch.Generator().manual_seed(1)
    mods = {"m": ("m.lora_A.default.weight", "m.lora_B.default.weight", "m.lora_dense")}
    d0 = torch.randn(3, 4, generator=g)
    ranks, n = [3, 1, 2], [10.0, 30.0, 60.0]
    ups, As, Bs = [], [], []
    for r in ranks:
        a, b = torch.randn(r, 4, generator=g), torch.randn(3, r, generator=g)
        As.append(a)
        Bs.append(b)
        ups.append(F.merged_upload({mods["m"][0]: a, mods["m"][1]: b, "m.lora_dense": d0}, mods,
                                   {mods["m"][0]: 2.0}))
    p = [x / sum(n) for x in n]
    a_st = torch.cat([pk * a for pk, a in zip(p, As)]).double()
    b_st = torch.cat(Bs, 1).double()
    want = d0.double() + 2.0 * b_st @ a_st
    assert a_st.shape == (6, 4) and b_st.shape == (3, 6)
    assert torch.allclose(weighted_mean(ups, n)["m.lora_dense"].double(), want, atol=1e-5)


def test_clients_train_fresh_lora_at_their_rank_and_the_base_merges(tiny_cfg, capture_uploads):
    n_train = len(build(tiny_cfg(**FL)).train_ids)
    exp = build(tiny_cfg(**FL, server__rounds=2, server__clients_per_round=n_train))
    infos = exp.model.param_infos()
    mods = F.modules_of(infos)
    assert mods and sorted(d for _, _, d in mods.values()) == exp.global_names  # only the dense base travels
    store = MemoryStore()
    state = run_rounds(exp, store, lambda r: None)
    sc = exp.model.scalings()
    last = [(cid, wire.decode(up)) for rnd, cid, up in capture_uploads if rnd == 2]
    first = {cid: wire.decode(up) for rnd, cid, up in capture_uploads if rnd == 1}
    base1 = weighted_mean(list(first.values()), [len(exp.clients[c].train_idx) for c in first])
    for cid, up in last:
        r = [4, 1, 2][cid % 3]
        kept = {k[len("param/"):]: v for k, v in store.get(cid).items() if k.startswith("param/")}
        for a, b, d in mods.values():
            assert not kept[a][r:].any() and not kept[b][:, r:].any() and kept[b][:, :r].any()
            # the upload is the received base (frozen locally) plus this round's s·B A
            want = base1[d].double() + sc[a] * (kept[b].double() @ kept[a].double())
            assert torch.allclose(up[d].double(), want, atol=1e-5)
    # every round starts from a fresh LoRA: the seeded init's A (first r rows) and B = 0
    cid = last[0][0]
    start, _ = exp.recipe.exchange.receive(tasks.OnClient(exp, cid), 2, base1, {})
    r = [4, 1, 2][cid % 3]
    for a, b, d in mods.values():
        assert torch.equal(start[a][:r], exp.init_params[a][:r]) and not start[a][r:].any()
        assert not start[b].any() and torch.equal(start[d], base1[d])
    n = [len(exp.clients[c].train_idx) for c, _ in last]
    new = weighted_mean([u for _, u in last], n)
    assert all(torch.allclose(state["global_params"][d].double(), new[d].double(), atol=1e-6)
               for _, _, d in mods.values())


@pytest.mark.parametrize("sets,match", [
    (["method.ranks=[2, 8]"], "method.ranks must be <= peft.r = 4"),
    (["client.upload=\"int8\""], "algorithm 'flora' aggregates exactly"),
    (["peft.type=\"prompt\""], "algorithm 'flora' stacks clients' LoRA adapters: set peft.type"),
])
def test_bad_parameters_exit_2_with_one_line(sets, match, tiny_cfg, cli_refuses):
    cli_refuses(tiny_cfg(**FL), sets, match)
