"""Multimodal heterogeneity scenarios (fedsplice.data.scenarios) on a synthetic image + text data set."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest

from fedsplice.config import ExperimentConfig, ScenarioConfig, from_dict
from fedsplice.core.streams import SCENARIO, rng
from fedsplice.data.datasets import TextDataset
from fedsplice.data.samples import Sample
from fedsplice.data.scenarios import apply_scenario, count_of, gaussian_noise, noise_tag, summary_line
from fedsplice.errors import ConfigError
from fedsplice.federation.experiment import make_clients

C, PER_CLASS, N_TEST = 10, 40, 10  # 300 training and 100 global test samples


def synthetic(per_class: int = PER_CLASS, kind: str = "both", grey: bool = False, seed: int = 0) -> TextDataset:
    """C classes × per_class samples of 8×8 RGB images + short texts, the last N_TEST of each
    class in the balanced test set. kind: both | image | text (plain strings) | mixed."""
    g = np.random.default_rng(seed)
    tr_x, tr_y, te_x, te_y = [], [], [], []
    for c in range(C):
        for j in range(per_class):
            key = f"syn/{c}/{j}"
            img = (np.full((8, 8, 3), 128, np.uint8) if grey
                   else g.integers(0, 256, (8, 8, 3), dtype=np.uint8))
            text = f"class {c} item {j}"
            k = {"mixed": ("both", "image", "text")[j % 3]}.get(kind, kind)
            s = (text if k == "text" and kind == "text" else
                 Sample(key, img, None) if k == "image" else
                 Sample(key, None, text) if k == "text" else Sample(key, img, text))
            (te_x if j >= per_class - N_TEST else tr_x).append(s)
            (te_y if j >= per_class - N_TEST else tr_y).append(c)
    return TextDataset("synthetic", [f"c{c}" for c in range(C)], tr_x, np.array(tr_y, np.int64),
                       te_x, np.array(te_y, np.int64), "tests")


def setup(seed: int = 0, k: int = 10, data: TextDataset | None = None, **scenario):
    cfg = from_dict(ExperimentConfig, {"seed": seed, "data": {"num_clients": k, "alpha": 1.0,
                                                                "local_test_size": 20},
                                       "scenario": scenario})
    data = data or synthetic()
    clients = make_clients(cfg, data)
    return cfg, data, clients


def run(seed: int = 0, k: int = 10, data: TextDataset | None = None, **scenario):
    cfg, data, clients = setup(seed, k, data, **scenario)
    before = (list(data.train_texts), data.train_labels.copy(), list(data.test_texts),
              data.test_labels.copy(), [c.test_idx.copy() for c in clients])
    stats = apply_scenario(cfg.scenario, data, clients, rng(cfg, SCENARIO), seed=cfg.seed)
    return stats, data, clients, before


def lost(s) -> str | None:
    return "image" if str(s).endswith("|noimg") else "text" if str(s).endswith("|notext") else None


def within(p_hat: float, p: float, n: int, z: float = 4.0) -> bool:
    return abs(p_hat - p) <= z * math.sqrt(p * (1 - p) / n)


def client_losses(data, clients):
    """Per client: (#train samples lost image, lost text, n)."""
    out = []
    for c in clients:
        ls = [lost(data.train_texts[i]) for i in c.train_idx]
        out.append((ls.count("image"), ls.count("text"), len(ls)))
    return out


# ------------------------------------------------------------------------- missing modality


@pytest.mark.parametrize("beta", [0.3, 0.5])
def test_client_level_missing_hits_exactly_round_beta_k_clients(beta):
    stats, data, clients, _ = run(missing_rate=beta, missing_level="client", missing="text")
    per = client_losses(data, clients)
    hit = [i for i, (mi, mt, n) in enumerate(per) if mi + mt]
    assert len(hit) == round(beta * 10) == stats["totals"]["missing_clients"]
    for i in hit:  # every sample of a hit client lost the text, none the image
        assert per[i] == (0, per[i][2], per[i][2])
        assert all(data.train_texts[j].text is None and data.train_texts[j].image is not None
                   for j in clients[i].train_idx)
    assert stats["shares"]["missing_clients"] == pytest.approx(beta)
    assert stats["totals"]["missing_text"] == sum(per[i][2] for i in hit)
    assert stats["totals"]["missing_image"] == 0
    assert [r["role"] == "missing" for r in stats["clients"]] == [i in hit for i in range(10)]


def test_count_rounds_half_up():
    assert [count_of(0.5, 7), count_of(0.3, 10), count_of(0.25, 10), count_of(0.0, 10), count_of(1.0, 9)] == \
        [4, 3, 3, 0, 9]
    stats, *_ = run(k=7, missing_rate=0.5, missing_level="client", missing="image")
    assert stats["totals"]["missing_clients"] == 4


@pytest.mark.parametrize("beta", [0.3, 0.5])
def test_sample_level_missing_share_is_beta(beta):
    stats, data, clients, _ = run(missing_rate=beta, missing_level="sample", missing="image")
    n_lost = sum(lost(s) == "image" for s in data.train_texts)
    assert sum(lost(s) == "text" for s in data.train_texts) == 0
    n = len(data.train_texts)
    assert stats["totals"]["missing_image"] == n_lost and stats["totals"]["eligible"] == n
    assert within(n_lost / n, beta, n), n_lost / n
    assert stats["shares"]["missing"] == pytest.approx(n_lost / n)
    # every client is hit at sample level, none is fully without loss by design
    assert stats["totals"]["missing_clients"] == 10 and stats["totals"]["aligned_clients"] == 0
    # the local test copies are drawn from the same stream at the same rate
    t = stats["test_totals"]
    assert within(t["missing_image"] / t["eligible"], beta, t["eligible"])


def test_either_splits_image_and_text_about_evenly():
    # per sample
    stats, data, _, _ = run(missing_rate=1.0, missing_level="sample", missing="either")
    n = len(data.train_texts)
    mi, mt = stats["totals"]["missing_image"], stats["totals"]["missing_text"]
    assert mi + mt == n and within(mi / n, 0.5, n) and mi > 0 and mt > 0
    # per client: each chosen client loses one modality on all its samples, drawn with p = 1/2
    stats, data, clients, _ = run(k=40, data=synthetic(per_class=60), missing_rate=1.0,
                                  missing_level="client", missing="either")
    kinds = []
    for c in clients:
        ls = {lost(data.train_texts[i]) for i in c.train_idx}
        assert len(ls) == 1 and None not in ls, ls  # all lost, and all the same modality
        kinds.append(ls.pop())
    assert [r["loses"] for r in stats["clients"]] == kinds
    assert within(kinds.count("image") / 40, 0.5, 40) and 0 < kinds.count("image") < 40


def test_hybrid_keeps_exactly_round_pk_clients_aligned():
    p, beta = 0.3, 0.5
    stats, data, clients, _ = run(missing_rate=beta, missing_level="sample", missing="either", aligned_share=p)
    per = client_losses(data, clients)
    aligned = [i for i, r in enumerate(stats["clients"]) if r["role"] == "aligned"]
    assert len(aligned) == round(p * 10) == stats["totals"]["aligned_clients"]
    assert all(per[i][:2] == (0, 0) for i in aligned)
    others = [i for i in range(10) if i not in aligned]
    n = sum(per[i][2] for i in others)
    k = sum(per[i][0] + per[i][1] for i in others)
    assert within(k / n, beta, n), k / n
    for i in aligned:  # aligned clients keep their local test set in the global test set
        assert (clients[i].test_idx < data.global_test_size).all()


def test_modality_dominant_five_and_five():
    stats, data, clients, _ = run(image_dominant=5, text_dominant=5, dominant_rate=0.8)
    roles = [r["role"] for r in stats["clients"]]
    assert roles.count("image_dominant") == 5 and roles.count("text_dominant") == 5
    per = client_losses(data, clients)
    img_dom = [i for i, r in enumerate(roles) if r == "image_dominant"]
    txt_dom = [i for i, r in enumerate(roles) if r == "text_dominant"]
    assert all(per[i][0] == 0 for i in img_dom) and all(per[i][1] == 0 for i in txt_dom)
    n_i = sum(per[i][2] for i in img_dom)
    n_t = sum(per[i][2] for i in txt_dom)
    assert within(sum(per[i][1] for i in img_dom) / n_i, 0.8, n_i)
    assert within(sum(per[i][0] for i in txt_dom) / n_t, 0.8, n_t)
    assert stats["totals"]["image_dominant_clients"] == stats["totals"]["text_dominant_clients"] == 5
    # the first image_dominant clients of the generator's order: a different seed, other clients
    other, *_ = run(seed=1, image_dominant=5, text_dominant=5)
    assert [r["role"] for r in other["clients"]] != roles


def test_only_samples_with_both_modalities_lose_one():
    stats, data, clients, before = run(data=synthetic(kind="mixed"), missing_rate=1.0,
                                       missing_level="sample", missing="either")
    for old, new in zip(before[0], data.train_texts):
        if old.has_image and old.has_text:
            assert lost(new) is not None
        else:
            assert new is old  # an image-only or text-only sample is left alone
        assert new.has_image or new.has_text
    assert stats["totals"]["eligible"] == sum(s.has_image and s.has_text for s in before[0])
    assert stats["shares"]["missing"] == 1.0


# ---------------------------------------------------------------------------------- noise


def test_noise_std_matches_sigma_on_mid_grey_images():
    std = 0.1
    stats, data, clients, before = run(data=synthetic(grey=True), noise_std=std, noise_clients=1.0)
    diffs = []
    for old, new in zip(before[0], data.train_texts):
        assert str(new) == f"{old}|{noise_tag(std, 0)}" and new.text == old.text
        assert new.image.dtype == np.uint8 and new.image.shape == old.image.shape
        diffs.append(new.image.astype(np.float64) - old.image)
    d = np.concatenate([x.ravel() for x in diffs])
    sigma = std * 255  # 25.5; rounding adds 1/12 to the variance, clipping at ±5σ nothing
    assert abs(d.std() - sigma) < 0.02 * sigma, d.std()
    assert abs(d.mean()) < 0.02 * sigma
    assert stats["sigma"] == pytest.approx(sigma)
    assert stats["totals"]["noisy_clients"] == 10 and stats["totals"]["noisy_images"] == len(data.train_texts)


def test_noise_is_clipped_not_wrapped():
    img = np.full((64, 64, 3), 250, np.uint8)
    out = gaussian_noise(img, 25.5, "k", 0)
    assert out.dtype == np.uint8
    # P(250 + 25.5 z >= 254.5) = P(z >= 0.176) = 0.430: those clip to 255; a uint8 wrap-around
    # would instead put them near 0
    assert abs((out == 255).mean() - 0.430) < 0.03
    assert out.min() > 100  # the lowest of 12288 draws: ~250 - 4σ
    dark = gaussian_noise(np.zeros((64, 64), np.uint8), 255.0, "k", 0)
    assert abs((dark == 0).mean() - 0.5) < 0.03 and dark.max() == 255  # both ends clipped


def test_noise_is_a_function_of_seed_key_and_sigma():
    img = np.full((8, 8, 3), 128, np.uint8)
    a = gaussian_noise(img, 25.5, "syn/0/1", 0)
    assert np.array_equal(a, gaussian_noise(img, 25.5, "syn/0/1", 0))
    assert not np.array_equal(a, gaussian_noise(img, 25.5, "syn/0/2", 0))
    assert not np.array_equal(a, gaussian_noise(img, 25.5, "syn/0/1", 1))
    assert not np.array_equal(a, gaussian_noise(img, 12.75, "syn/0/1", 0))


def test_noisy_clients_count_and_shared_test_copies_have_one_key_one_image():
    stats, data, clients, before = run(noise_std=0.2, noise_clients=0.3)
    noisy = [r["noisy"] for r in stats["clients"]]
    assert sum(noisy) == 3
    for c, is_noisy in zip(clients, noisy):
        changed = [data.train_texts[i] is not before[0][i] for i in c.train_idx]
        assert all(changed) if is_noisy else not any(changed)
    n_glob = data.global_test_size
    copies = data.test_texts[n_glob:]
    assert len({str(s) for s in copies}) == len(copies)  # one entry per key
    originals = {i for c, z in zip(clients, noisy) if z for i in before[4][c.cid]}
    assert len(copies) == len(originals) == stats["local_test_copies"]
    for s, y in zip(copies, data.test_labels[n_glob:]):
        key = str(s).split("|")[0]
        j = next(i for i in originals if str(before[2][i]) == key)
        assert np.array_equal(s.image, gaussian_noise(before[2][j].image, 0.2 * 255, key, 0))
        assert y == before[3][j]


# ----------------------------------------------------------------------- seeds and data sets


def _snapshot(data):
    return ([str(s) for s in data.train_texts] + [str(s) for s in data.test_texts],
            [s.image for s in data.train_texts + data.test_texts if s.image is not None])


def test_same_seed_same_keys_and_pixels_other_seed_differs():
    kw = dict(missing_rate=0.5, missing_level="sample", missing="either", noise_std=0.1, noise_clients=0.5)
    a = run(seed=3, **kw)
    b = run(seed=3, **kw)
    c = run(seed=4, data=synthetic(), **kw)
    (ka, ia), (kb, ib), (kc, _) = _snapshot(a[1]), _snapshot(b[1]), _snapshot(c[1])
    assert ka == kb and len(ia) == len(ib) and all(np.array_equal(x, y) for x, y in zip(ia, ib))
    assert a[0] == b[0]
    assert [list(x.test_idx) for x in a[2]] == [list(x.test_idx) for x in b[2]]
    assert ka != kc


def test_global_test_set_untouched_and_local_copies_consistent():
    stats, data, clients, before = run(missing_rate=0.5, missing_level="sample", missing="either",
                                       noise_std=0.1)
    n = len(before[2])
    assert data.n_global_test == n == stats["global_test_size"]
    assert all(x is y for x, y in zip(data.test_texts[:n], before[2]))
    assert np.array_equal(data.test_labels[:n], before[3])
    assert len(data.test_texts) == len(data.test_labels) == n + stats["local_test_copies"] > n
    assert np.array_equal(data.train_labels, before[1])
    for c, old_idx in zip(clients, before[4]):
        assert len(c.test_idx) == len(old_idx)
        assert np.array_equal(data.test_labels[c.test_idx], before[3][old_idx])
        for i_new, i_old in zip(c.test_idx, old_idx):
            new, old = data.test_texts[i_new], before[2][i_old]
            if i_new < n:
                assert i_new == i_old and new is old
            else:
                assert str(new).startswith(f"{old}|") and str(new) != str(old)
    for old, new in zip(before[0], data.train_texts):
        assert new is old or str(new).startswith(f"{old}|")


def test_inactive_scenario_changes_nothing():
    cfg, data, clients = setup()
    ref = copy.deepcopy((data, clients))
    assert not cfg.scenario.active()
    # aligned_share and dominant_rate alone do nothing
    sc = ScenarioConfig(aligned_share=0.5, missing_level="sample", dominant_rate=0.3)
    assert apply_scenario(sc, data, clients, rng(cfg, SCENARIO), seed=0) == {}
    assert data.n_global_test is None
    assert [str(s) for s in data.train_texts] == [str(s) for s in ref[0].train_texts]
    assert all(x is y or np.array_equal(x.image, y.image) for x, y in zip(data.train_texts, ref[0].train_texts))
    assert data.test_texts == ref[0].test_texts and np.array_equal(data.test_labels, ref[0].test_labels)
    assert all(np.array_equal(a.test_idx, b.test_idx) for a, b in zip(clients, ref[1]))


@pytest.mark.parametrize("kind, scenario, field", [
    ("text", {"missing_rate": 0.3}, "scenario.missing_rate"),
    ("image", {"missing_rate": 0.3, "missing": "text"}, "scenario.missing_rate"),
    ("image", {"image_dominant": 2}, "scenario.image_dominant"),
    ("text", {"text_dominant": 2}, "scenario.text_dominant"),
    ("text", {"noise_std": 0.1}, "scenario.noise_std"),
])
def test_data_without_the_needed_modalities_is_a_config_error(kind, scenario, field):
    data = synthetic(kind=kind)
    snapshot = [str(s) for s in data.train_texts]
    with pytest.raises(ConfigError) as e:
        run(data=data, **scenario)
    msg = str(e.value)
    assert msg.startswith(field) and "\n" not in msg
    assert ("easyvqa" in msg) and ("image" in msg)
    assert [str(s) for s in data.train_texts] == snapshot and data.n_global_test is None


def test_summary_line():
    stats, *_ = run(missing_rate=0.3, missing_level="client", missing="image", noise_std=0.1, noise_clients=0.2)
    line = summary_line(stats)
    t = stats["totals"]
    assert line.startswith("scenario: 3/10 clients missing a modality (client level, 7 aligned)")
    assert f"image {t['missing_image']}, text 0" in line and "noise σ=25.5 on 2/10 clients" in line
    assert "\n" not in line
    json.dumps(stats)  # plain JSON types only


# ------------------------------------------------------------------------ build and runner


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from fedsplice.data import zoo

    return str(zoo.tiny_clip(tmp_path_factory.mktemp("m") / "clip"))


def test_build_and_runner_write_the_scenario(cfg_factory, clip_dir, toy_jsonl, tmp_path, monkeypatch, capsys):
    """End to end on a tiny CLIP: build() applies the scenario from its own stream, GM sees the
    global test set only, and the run folder holds scenario.json."""
    import fedsplice.federation.experiment as E
    from fedsplice.app.runner import run_experiment
    from fedsplice.federation.evaluation import evaluate_global

    monkeypatch.setattr(E, "load_dataset", lambda *a, **k: synthetic(per_class=14))
    small = dict(server__rounds=1, server__clients_per_round=1, data__holdout_clients=0, client__max_steps=1,
                 data__class_prompt='"a photo of a {label}."', peft__tower='"vision_model"')
    cfg = cfg_factory(clip_dir, toy_jsonl, scenario__missing_rate=0.5, scenario__missing="either",
                      scenario__noise_std=0.1, **small)
    exp = E.build(cfg)
    n = exp.data.global_test_size
    assert n == C * N_TEST and len(exp.data.test_texts) == n + exp.scenario["local_test_copies"] > n
    assert exp.scenario["totals"]["missing_clients"] == 2 and exp.scenario["totals"]["noisy_clients"] == 4

    seen = []
    predict = exp.model.predict
    monkeypatch.setattr(exp.model, "predict", lambda texts, bs: seen.append(list(texts)) or predict(texts, bs))
    # a trained model (a LoRA B moved): the zero-shot one would be scored from the build's cache
    params = {k: t.detach() + (0.01 if ".lora_B." in k else 0.0) for k, t in exp.model.trainable().items()}
    gm = evaluate_global(exp, {k: params[k] for k in exp.global_names})
    assert seen == [exp.data.test_texts[:n]] and 0 <= gm["accuracy"] <= 1  # the clean global set only

    run_experiment(cfg, tmp_path / "run")  # builds again: the same seeded scenario
    written = json.loads((tmp_path / "run" / "scenario.json").read_text())
    assert written == json.loads(json.dumps(exp.scenario))
    assert summary_line(exp.scenario) in capsys.readouterr().err
    # a later run without a scenario in the same folder leaves no stale scenario.json
    run_experiment(cfg_factory(clip_dir, toy_jsonl, **small), tmp_path / "run", overwrite=True, quiet=True)
    assert not (tmp_path / "run" / "scenario.json").exists()
