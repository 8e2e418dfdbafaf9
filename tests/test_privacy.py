"""[privacy] (DP-FedAvg on the GLOBAL updates): clipping and aggregation on hand-computed tensors,
the noise's scale over many draws, ε against Opacus' published values, a tiny run whose
aggregate is the fixed-weight sum over m, and bad settings."""

import json
import math

import pytest
import torch

from fedsplice.core import privacy as dp
from fedsplice.core import wire
from fedsplice.federation import privacy as FP
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.runtimes.inprocess import run_rounds

pytestmark = pytest.mark.unit


def plan(mode="central", clip=1.0, z=0.0, m=2, seeded=True):
    return FP.Plan(mode, clip, z, m, 0.5, 1e-5, "rdp", seeded)


def test_clip_scales_the_whole_update_as_one_vector():
    u = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[0.0], [4.0]])}  # ‖u‖ = 5
    c, norm = dp.clip(u, 1.0)
    assert norm == 5.0
    assert torch.allclose(c["a"], torch.tensor([0.6, 0.0], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(c["b"], torch.tensor([[0.0], [0.8]], dtype=torch.float64), rtol=0, atol=1e-15)
    same, _ = dp.clip(u, 10.0)  # within the bound: unchanged
    assert all(torch.equal(same[k], u[k].double()) for k in u)
    zero, n0 = dp.clip({"a": torch.zeros(3)}, 1.0)
    assert n0 == 0.0 and not zero["a"].any()


def test_central_aggregate_is_the_clipped_sum_over_m():
    u1 = {"w": torch.tensor([3.0, 4.0])}  # norm 5 -> clipped to [0.6, 0.8]
    u2 = {"w": torch.tensor([0.0, 0.5])}  # within the bound
    cfg = type("C", (), {"seed": 0})()
    mean, stats = FP.server_aggregate(plan(m=4), cfg, 1, [u1, u2])  # m = 4 planned, 2 came: a smaller sum
    assert torch.allclose(mean["w"], torch.tensor([0.6 / 4, 1.3 / 4], dtype=torch.float64), atol=1e-15)
    assert stats == {"dp_clipped": 0.5, "dp_norm": 5.0}
    dist, none = FP.server_aggregate(plan("distributed", m=4), cfg, 1, [u1, u2])  # clients clipped already
    assert torch.allclose(dist["w"], torch.tensor([3.0 / 4, 4.5 / 4], dtype=torch.float64)) and none == {}


def test_noise_has_the_stated_scale_and_seeded_noise_reproduces():
    cfg = type("C", (), {"seed": 3})()
    big = {"w": torch.zeros(200_000)}
    noisy, _ = FP.server_aggregate(plan(clip=0.5, z=2.0, m=4), cfg, 7, [big])
    x = noisy["w"] * 4  # the sum's noise: std z·S = 1
    assert abs(float(x.std()) - 1.0) < 0.01 and abs(float(x.mean())) < 0.01
    again, _ = FP.server_aggregate(plan(clip=0.5, z=2.0, m=4), cfg, 7, [big])
    assert torch.equal(again["w"], noisy["w"])
    other, _ = FP.server_aggregate(plan(clip=0.5, z=2.0, m=4), cfg, 8, [big])  # another round, other noise
    assert not torch.equal(other["w"], noisy["w"])
    secure = [FP.server_aggregate(plan(clip=0.5, z=2.0, m=4, seeded=False), cfg, 7, [big])[0]["w"] for _ in "ab"]
    assert not torch.equal(secure[0], secure[1])  # from the OS's entropy: never the same twice
    # distributed: each of m clients adds std z·S/√m, so m shares sum to std z·S
    recv = {"w": torch.zeros(200_000)}
    sent = FP.client_release(plan("distributed", clip=0.5, z=2.0, m=4), cfg, 1, 7, {"w": torch.zeros(200_000)}, recv)
    assert sent["w"].dtype == torch.float32 and abs(float(sent["w"].std()) - 0.5) < 0.005


def test_client_release_clips_the_update_not_the_tensors():
    cfg = type("C", (), {"seed": 0})()
    recv = {"w": torch.tensor([10.0, 10.0])}
    trained = {"w": torch.tensor([13.0, 14.0])}  # update [3, 4]: norm 5
    pl = plan("distributed", clip=1.0, z=1e-12, m=1)
    assert torch.allclose(FP.client_release(pl, cfg, 0, 1, trained, recv)["w"], torch.tensor([10.6, 10.8]))
    assert FP.client_release(plan("central"), cfg, 0, 1, trained, recv) is trained


def test_epsilon_against_opacus_published_values():
    # opacus/tests/accountants_test.py: σ = 1.5, q = 0.04, 90 epochs (2250 steps), δ = 1e-5
    assert FP.epsilon(1.5, 0.04, 2250, 1e-5) == pytest.approx(7.32911117143, rel=1e-6)
    # the search stops within Opacus' tolerance (0.01) below the target, never above it
    z = FP.noise_for(8.0, 1e-5, 0.04, 2250)
    assert 8.0 - 0.01 <= FP.epsilon(z, 0.04, 2250, 1e-5) <= 8.0
    assert FP.epsilon(1.5, 0.04, 0, 1e-5) == 0.0
    # PRV is the tighter accountant
    assert FP.epsilon(1.0, 0.25, 20, 1e-5, "prv") < FP.epsilon(1.0, 0.25, 20, 1e-5, "rdp")


def test_a_run_releases_the_fixed_weight_sum_and_logs_epsilon(tiny_cfg, capture_uploads):
    # clip far above any update, noise std 1e-9: the release is Σ deltas / m, whatever the sample counts
    cfg = tiny_cfg(privacy__mode='"central"', privacy__clip=1e3, privacy__noise_multiplier=1e-12,
                   privacy__noise='"seeded"', server__rounds=1)
    exp = build(cfg)
    start = {n: exp.init_params[n] for n in exp.global_names}
    records = []
    state = run_rounds(exp, MemoryStore(), records.append)
    ups = [wire.decode(up) for _, _, up in capture_uploads]
    assert len(ups) == 2 and sorted(ups[0]) == sorted(exp.global_names)  # PRIVATE names never travel
    for n in exp.global_names:
        want = start[n].double() + sum(u[n].double() - start[n].double() for u in ups) / 2
        assert torch.allclose(state["global_params"][n].double(), want, atol=1e-6)
    assert records[1]["dp_epsilon"] == pytest.approx(FP.epsilon(1e-12, 2 / 3, 1, 1e-5))
    assert records[1]["dp_clipped"] == 0.0 and records[1]["dp_norm"] > 0


def test_target_epsilon_picks_the_noise_for_the_planned_rounds(tiny_cfg):
    cfg = tiny_cfg(privacy__mode='"distributed"', privacy__clip=0.1, privacy__target_epsilon=3.0,
                   server__rounds=4)
    pl = FP.plan(cfg, 3)
    assert pl.sample_rate == pytest.approx(2 / 3) and pl.noise_multiplier > 0
    assert 2.8 < pl.epsilon(4) <= 3.0 and pl.epsilon(2) < pl.epsilon(4)
    assert FP.plan(tiny_cfg(), 3) is None


def test_cli_run_reports_epsilon_in_results_and_metrics(tiny_cfg, tmp_path, capsys):
    from fedsplice.app.cli import main
    from fedsplice.app.rundir import write_config

    write_config(tmp_path, tiny_cfg(privacy__mode='"distributed"', privacy__clip=0.5,
                                    privacy__noise_multiplier=1.0, privacy__noise='"seeded"'))
    assert main(["run", str(tmp_path / "config.toml"), "--out", str(tmp_path / "run")]) == 0
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    shown = " ".join(capsys.readouterr().out.split())  # the final table's caption
    assert f"DP (distributed): ε = {res['privacy']['epsilon']:.4g} at δ = 1e-05 after 2 rounds" in shown
    assert f"ε = {res['privacy']['server_view_epsilon']:.4g} without secure aggregation" in shown
    eps = [json.loads(x).get("dp_epsilon") for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    p = res["privacy"]
    assert eps[0] is None and eps[-1] == p["epsilon"] and eps[1] < eps[2]
    assert p["mode"] == "distributed" and p["rounds"] == 2 and p["noise_multiplier"] == 1.0
    assert p["epsilon"] == pytest.approx(FP.epsilon(1.0, 2 / 3, 2, 1e-5)) and math.isfinite(p["epsilon"])
    # a server reading each upload sees noise z/√m = 1/√2 and knows who it sampled: q = 1
    assert p["server_view_epsilon"] == pytest.approx(FP.epsilon(2 ** -0.5, 1.0, 2, 1e-5))
    assert p["server_view_epsilon"] > p["epsilon"]


@pytest.mark.parametrize("sets,match", [
    (["privacy.mode=\"central\"", "privacy.clip=-1", "privacy.noise_multiplier=1"], "privacy.clip must be > 0"),
    (["privacy.mode=\"central\"", "privacy.clip=1"], "with no noise gives no privacy"),
    (["privacy.mode=\"central\"", "privacy.clip=1", "privacy.noise_multiplier=1", "privacy.target_epsilon=2"],
     "are both set: keep one"),
    (["privacy.mode=\"central\"", "privacy.clip=1", "privacy.noise_multiplier=1", "server.aggregation=\"median\""],
     "set server.aggregation = 'mean'"),
    (["privacy.mode=\"central\"", "privacy.clip=1", "privacy.noise_multiplier=1", "algorithm=\"hetlora\"",
      "method={}"], "needs one weight per client"),
    (["privacy.mode=\"central\"", "privacy.clip=1", "privacy.noise_multiplier=1", "algorithm=\"local\"",
      "method={}"], "sends nothing to a server"),
])
def test_bad_privacy_settings_exit_2_with_one_line(sets, match, tiny_cfg, cli_refuses):
    cli_refuses(tiny_cfg(), sets, match)
