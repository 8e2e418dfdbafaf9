"""Multimodal heterogeneity scenarios (PFAdapter §V) as a seeded transform of the clients' data.

After partitioning, `apply_scenario` decides per client what it loses (the image, the text, or
either, on all or a share of its samples) and whether its images are noisy, then rewrites the
samples that change as derived `Sample`s (`key|noimg`, `key|notext`, `key|noise=σ,seed=s`):

    training samples   each belongs to exactly one client: replaced in place in train_texts
    local test sets    they point into the shared test set (where clients may overlap), so a
                       changed sample is appended to test_texts (once per key) and the client's
                       test_idx is repointed to it; test_texts[:n_global_test] stays the clean,
                       aligned global test set on which GM is measured

The client-level choices come first from the generator, then every client's per-sample draws
(train, then local test) in client order, so the same seed gives the same keys and pixels.
Only a sample holding both modalities may lose one: no sample ever ends up with neither.
Noise is a function of (seed, sample key, σ) alone, so a key always names the same pixels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np

from fedsplice.config import ScenarioConfig
from fedsplice.core import streams
from fedsplice.data.datasets import TextDataset
from fedsplice.data.partition import Client
from fedsplice.data.samples import Sample, modalities
from fedsplice.errors import ConfigError

IMAGE_TEXT_DATASETS = ("image+text data sets: easyvqa, tuxpaint, emoji, or a csv:/jsonl: file with "
                       "image and text columns")
IMAGE_DATASETS = ("data sets with images: easyvqa, tuxpaint, emoji, fashion_mnist, images:DIR, or a "
                  "csv:/jsonl: file with an image column")


def count_of(share: float, k: int) -> int:
    """round(share·k), halves rounded up (Python's round() would send 2.5 to 2)."""
    return int(math.floor(share * k + 0.5 + 1e-9))


def noise_tag(noise_std: float, seed: int) -> str:
    return f"noise={noise_std:g},seed={seed}"


def gaussian_noise(image: np.ndarray, sigma: float, key: str, seed: int) -> np.ndarray:
    """image + N(0, σ²) per pixel, rounded and clipped to uint8 [0, 255]. The noise is drawn from
    a generator seeded by (seed, sample key) only, so the same key gets the same pixels."""
    digest = hashlib.sha256(str(key).encode()).digest()
    words = np.frombuffer(digest[:16], dtype=np.uint32).tolist()
    z = np.random.default_rng([seed, streams.SCENARIO_NOISE, *words]).standard_normal(image.shape)
    return np.clip(np.rint(image.astype(np.float64) + sigma * z), 0, 255).astype(np.uint8)


@dataclasses.dataclass
class _Plan:
    """What one client loses: `loses` image/text/either (None: aligned) on a share `rate`."""

    role: str  # aligned | missing | image_dominant | text_dominant
    loses: str | None = None
    rate: float = 0.0
    noisy: bool = False


def _check_data(sc: ScenarioConfig, data: TextDataset) -> None:
    m = modalities(list(data.train_texts) + list(data.test_texts[:data.global_test_size]))
    drops = sc.missing_rate > 0 or sc.image_dominant or sc.text_dominant
    if drops and m["both"] == 0:
        field = ("scenario.missing_rate" if sc.missing_rate > 0 else
                 "scenario.image_dominant" if sc.image_dominant else "scenario.text_dominant")
        raise ConfigError(f"{field}: data set {data.name!r} has no sample with both an image and a text, "
                          f"so none can lose a modality; use one of the {IMAGE_TEXT_DATASETS}")
    if sc.noise_std > 0 and m["image"] == 0:
        raise ConfigError(f"scenario.noise_std: data set {data.name!r} has no images to add noise to; "
                          f"use one of the {IMAGE_DATASETS}, or set scenario.noise_std = 0")


def _plans(sc: ScenarioConfig, k: int, g: np.random.Generator) -> list[_Plan]:
    plans = [_Plan("aligned") for _ in range(k)]
    if sc.missing_rate > 0 or sc.image_dominant or sc.text_dominant:
        order = g.permutation(k).tolist()
        if sc.image_dominant or sc.text_dominant:
            for cid in order[:sc.image_dominant]:
                plans[cid] = _Plan("image_dominant", "text", sc.dominant_rate)
            for cid in order[sc.image_dominant:sc.image_dominant + sc.text_dominant]:
                plans[cid] = _Plan("text_dominant", "image", sc.dominant_rate)
        elif sc.missing_level == "client":
            for cid in sorted(order[:count_of(sc.missing_rate, k)]):
                loses = sc.missing
                if loses == "either":  # drawn per client
                    loses = "image" if g.random() < 0.5 else "text"
                plans[cid] = _Plan("missing", loses, 1.0)
        else:  # sample level; hybrid: the first round(p·K) stay aligned
            for cid in order[count_of(sc.aligned_share, k):]:
                plans[cid] = _Plan("missing", sc.missing, sc.missing_rate)
    if sc.noise_std > 0:
        for cid in g.permutation(k)[:count_of(sc.noise_clients, k)].tolist():
            plans[cid].noisy = True
    return plans


def _transform(items: list, plan: _Plan, g: np.random.Generator, sigma: float, tag: str,
               seed: int) -> tuple[list, dict]:
    """The client's copies of `items` (unchanged ones are the same objects) and their counts."""
    out, n_img, n_txt, n_noisy, eligible = [], 0, 0, 0, 0
    draws = g.random((len(items), 2)) if plan.loses else None  # (lose?, which one if "either")
    for j, s in enumerate(items):
        if not isinstance(s, Sample):  # a plain text: nothing to lose, no image
            out.append(s)
            continue
        both = s.has_image and s.has_text
        eligible += both
        drop = None
        if plan.loses and both and draws is not None and draws[j, 0] < plan.rate:
            drop = plan.loses if plan.loses != "either" else ("image" if draws[j, 1] < 0.5 else "text")
        t = s
        if plan.noisy and s.image is not None and drop != "image":
            t = t.derive(tag, image=gaussian_noise(s.image, sigma, s, seed))
            n_noisy += 1
        if drop == "image":
            t, n_img = t.derive("noimg", image=None), n_img + 1
        elif drop == "text":
            t, n_txt = t.derive("notext", text=None), n_txt + 1
        out.append(t)
    return out, {"n": len(items), "eligible": eligible, "missing_image": n_img, "missing_text": n_txt,
                 "noisy_images": n_noisy}


def apply_scenario(sc: ScenarioConfig, data: TextDataset, clients: list[Client], g: np.random.Generator,
                   *, seed: int) -> dict:
    """Apply scenario `sc` to the clients' training and local test samples in place (see the
    module docstring); `g` draws every choice, `seed` seeds the per-key noise. Returns the
    realised statistics ({} and nothing changed when the scenario is inactive)."""
    if not sc.active():
        return {}
    _check_data(sc, data)
    k = len(clients)
    plans = _plans(sc, k, g)
    sigma = sc.noise_std * 255.0
    tag = noise_tag(sc.noise_std, seed)
    n_global, n_test = data.global_test_size, len(data.test_texts)  # disjoint local test sets follow the global one
    data.n_global_test = n_global
    appended: dict[str, int] = {}  # key of a changed local test copy -> its index in test_texts
    new_texts: list[str] = []
    new_labels: list[int] = []
    rows = []
    for cid, (c, plan) in enumerate(zip(clients, plans)):
        row = {"cid": cid, "role": plan.role, "loses": plan.loses, "rate": plan.rate, "noisy": plan.noisy}
        tr = [data.train_texts[i] for i in c.train_idx]
        tr_out, tr_stats = _transform(tr, plan, g, sigma, tag, seed)
        for i, s in zip(c.train_idx.tolist(), tr_out):
            data.train_texts[i] = s
        te = [data.test_texts[i] for i in c.test_idx]
        te_out, te_stats = _transform(te, plan, g, sigma, tag, seed)
        idx = c.test_idx.copy()
        for j, (i, s) in enumerate(zip(c.test_idx.tolist(), te_out)):
            if s is data.test_texts[i]:
                continue  # unchanged: keep pointing into the global test set
            if s not in appended:
                appended[s] = n_test + len(new_texts)
                new_texts.append(s)
                new_labels.append(int(data.test_labels[i]))
            idx[j] = appended[s]
        c.test_idx = idx
        rows.append({**row, **tr_stats, "test": te_stats})
    if new_texts:
        data.test_texts = list(data.test_texts) + new_texts
        data.test_labels = np.concatenate([data.test_labels, np.asarray(new_labels, dtype=data.test_labels.dtype)])
    return _summary(sc, rows, n_global, len(new_texts), sigma)


def _summary(sc: ScenarioConfig, rows: list[dict], n_global: int, n_copies: int, sigma: float) -> dict:
    def total(key, part=None):
        return sum((r[part] if part else r)[key] for r in rows)

    k = len(rows)
    tot = {key: total(key) for key in ("n", "eligible", "missing_image", "missing_text", "noisy_images")}
    test = {key: total(key, "test") for key in ("n", "eligible", "missing_image", "missing_text", "noisy_images")}
    tot.update(missing_clients=sum(r["role"] == "missing" for r in rows),
               aligned_clients=sum(r["role"] == "aligned" for r in rows),
               image_dominant_clients=sum(r["role"] == "image_dominant" for r in rows),
               text_dominant_clients=sum(r["role"] == "text_dominant" for r in rows),
               noisy_clients=sum(r["noisy"] for r in rows))

    def share(a, b):
        return float(a / b) if b else 0.0

    lost = tot["missing_image"] + tot["missing_text"]
    shares = {"missing": share(lost, tot["eligible"]),
              "missing_image": share(tot["missing_image"], tot["eligible"]),
              "missing_text": share(tot["missing_text"], tot["eligible"]),
              "test_missing": share(test["missing_image"] + test["missing_text"], test["eligible"]),
              "missing_clients": share(tot["missing_clients"], k),
              "aligned_clients": share(tot["aligned_clients"], k),
              "noisy_clients": share(tot["noisy_clients"], k)}
    return {"config": dataclasses.asdict(sc), "sigma": sigma, "num_clients": k,
            "global_test_size": n_global, "local_test_copies": n_copies,
            "totals": tot, "test_totals": test, "shares": shares, "clients": rows}


def summary_line(stats: dict) -> str:
    """One line for the console: who lost what, how much, and the noise."""
    if not stats:
        return "scenario: none (all clients aligned)"
    t, s, k = stats["totals"], stats["shares"], stats["num_clients"]
    parts = []
    if t["image_dominant_clients"] or t["text_dominant_clients"]:
        parts.append(f"{t['image_dominant_clients']} image-dominant / {t['text_dominant_clients']} "
                     f"text-dominant clients")
    elif t["missing_clients"]:
        parts.append(f"{t['missing_clients']}/{k} clients missing a modality "
                     f"({stats['config']['missing_level']} level, {t['aligned_clients']} aligned)")
    if t["missing_image"] or t["missing_text"] or parts:
        parts.append(f"{t['missing_image'] + t['missing_text']}/{t['eligible']} train samples lost one "
                     f"({s['missing']:.1%}: image {t['missing_image']}, text {t['missing_text']})")
    if t["noisy_clients"]:
        parts.append(f"noise σ={stats['sigma']:.1f} on {t['noisy_clients']}/{k} clients "
                     f"({t['noisy_images']} train images)")
    parts.append(f"{stats['local_test_copies']} local test copies, "
                 f"global test {stats['global_test_size']} aligned")
    return "scenario: " + "; ".join(parts)
