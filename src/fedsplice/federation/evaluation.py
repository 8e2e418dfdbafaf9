"""Scoring: one client's metrics on its test samples, PM pooled over clients, and GM.

GM runs where the global test set is (the server in a deployment); per-client scoring runs in
the client tasks, where the client's data is (`fedsplice.federation.tasks`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedsplice.core.tkl import tkl
from fedsplice.federation.generative import scores as answer_scores
from fedsplice.federation.generative import summarize as summarize_answers
from fedsplice.federation.metrics import classification_metrics, longtail_metrics, per_class_counts, summarize_clients
from fedsplice.federation.state import ClientState

if TYPE_CHECKING:
    from fedsplice.core.server import Params
    from fedsplice.federation.experiment import Experiment
    from fedsplice.federation.metrics import Metrics
    from fedsplice.federation.store import Store


def prior_logits(exp: Experiment, cids: list[int], n: int) -> np.ndarray:
    """A prior reference's prediction for `n` samples, without the model: the log class prior of
    the training labels of clients `cids` (counts floored at 1e-3, so an absent class scores
    very low but finite); its argmax is their majority class, ties to the lowest index."""
    d = exp.data
    idx = np.concatenate([exp.clients[k].train_idx for k in cids])
    counts = np.maximum(np.bincount(d.train_labels[idx], minlength=len(d.class_names)), 1e-3)
    return np.tile(np.log(counts / counts.sum()).astype(np.float32), (n, 1))


def score(exp: Experiment, labels: np.ndarray, logits: np.ndarray, test_idx: np.ndarray) -> Metrics:
    """Metrics of logits on test samples `test_idx`, with what pooling needs: per-class counts of
    the model and of the zero-shot model on the same samples, and TKL to zero-shot. Without
    zero-shot logits (a prior reference never runs the model) there is no TKL, and the zero-shot
    counts are None."""
    m = _counted(exp, labels, logits)
    if "zero_shot_test" in exp.caches:
        zs = exp.caches["zero_shot_test"][torch.as_tensor(test_idx)]
        m["zs_class_correct"] = per_class_counts(labels, zs.numpy().argmax(1), len(exp.data.class_names))[0].tolist()
        m["tkl"] = float(tkl(torch.as_tensor(logits), zs).mean())
    return m


def _counted(exp: Experiment, labels: np.ndarray, logits: np.ndarray) -> Metrics:
    c = len(exp.data.class_names)
    m: Metrics = classification_metrics(labels, logits, c)
    correct, total = per_class_counts(labels, logits.argmax(1), c)
    m.update(class_correct=correct.tolist(), class_total=total.tolist(), zs_class_correct=None)
    return m


def references(exp: Experiment) -> dict[str, Metrics] | None:
    """The input-free references on this run's own split, scored exactly as the `majority` and
    `local-prior` algorithms score them (no model): `majority` predicts the pooled training
    prior's majority class everywhere; `local_prior` gives each client's PM from its own prior
    (its GM is the pooled prior, the same as majority's). Scalars only. None with per-site data,
    whose labels the server never holds."""
    if exp.caches.get("train_counts") is None or _answers(exp):  # free-text answers: no classes
        return None
    d, size = exp.data, exp.data.global_test_size
    gm = _counted(exp, d.test_labels[:size], prior_logits(exp, exp.train_ids, size))
    gm = with_longtail(exp, gm, gm["class_correct"], gm["class_total"], None)
    out = {}
    for name, own in (("majority", False), ("local_prior", True)):
        per_client = [_counted(exp, d.test_labels[exp.clients[k].test_idx],
                               prior_logits(exp, [k] if own else exp.train_ids, len(exp.clients[k].test_idx)))
                      for k in exp.train_ids]
        pm = summarize_pm(exp, per_client)
        out[name] = {"gm": _scalars(gm), "pm": _scalars(pm)}
    return out


def _answers(exp: Experiment) -> bool:
    """model.task = "generate": the model answers in free text (fedsplice.federation.generative)."""
    return getattr(exp.model, "task", None) == "generate"


def _scalars(m: Metrics) -> Metrics:
    """A reference's metrics without the per-class/per-client lists and the zero-shot comparisons."""
    return {k: v for k, v in m.items() if not isinstance(v, list) and k not in ("tkl", "head_bias")}


def with_longtail(exp: Experiment, m: Metrics, correct: np.ndarray, total: np.ndarray,
                  zs_correct: np.ndarray | None) -> Metrics:
    """The scalar metrics of `m` and the long-tail ones; head bias needs the zero-shot counts."""
    e = exp.cfg.eval
    out = {k: v for k, v in m.items() if not isinstance(v, list) and k != "zs_class_correct"}
    if exp.caches.get("train_counts") is None:  # per-site data: the server holds no class counts
        out["class_accuracy"] = [float(c / t) if t else None for c, t in zip(correct, total)]
        return out
    out.update(longtail_metrics(correct, total, correct if zs_correct is None else zs_correct,
                                exp.caches["train_counts"], many=e.many_threshold, few=e.few_threshold,
                                sigma=e.balancedness_sigma, min_group=e.min_group_samples))
    if zs_correct is None:
        out["head_bias"] = None
    # per class, in class order (None: no test sample of that class): the head-to-tail plots
    out["class_accuracy"] = [float(c / t) if t else None for c, t in zip(correct, total)]
    return out


def summarize_pm(exp: Experiment, per_client: list[Metrics]) -> Metrics:
    """PM: scalar metrics averaged over ALL clients (accuracy also std/min/max); the long-tail
    metrics pool the clients' local test predictions (per-class counts summed)."""
    if "response_loss" in per_client[0]:  # free-text answers (model.task = "generate")
        return summarize_answers(per_client)
    # the summed per-class counts; zero-shot ones are None where a client has none (a prior reference)
    pooled: list[Any] = [None if per_client[0][k] is None else np.sum([m[k] for m in per_client], axis=0)
              for k in ("class_correct", "class_total", "zs_class_correct")]
    out = with_longtail(exp, summarize_clients(per_client), *pooled)
    # per client, in the order given (the training clients): paired comparisons across methods
    out["client_accuracy"] = [float(m["accuracy"]) for m in per_client]
    return out


def pooled_gm(exp: Experiment, per_client: list[Metrics]) -> Metrics:
    """GM evaluated on the sites (per-site data, no server test set): the global model's metrics
    on the union of the clients' local test sets, from their summed confusion counts. AUC and TKL
    need the scores themselves, which stay on the sites: None."""
    conf = np.sum([np.asarray(m["confusion"]) for m in per_client], axis=0)
    total, pred, correct = conf.sum(1), conf.sum(0), np.diag(conf)
    with np.errstate(divide="ignore", invalid="ignore"):
        f1 = np.where(total + pred > 0, 2 * correct / (total + pred), 0.0)
    seen = (total + pred) > 0  # sklearn's macro F1 leaves out classes absent from labels and predictions
    m = {"accuracy": float(correct.sum() / max(conf.sum(), 1)), "f1_macro": float(f1[seen].mean()),
         "f1_weighted": float((f1 * total).sum() / max(total.sum(), 1)),
         "test_size": int(conf.sum()), "evaluated_on": "sites"}
    if len(exp.data.class_names) == 2:
        m["auc"] = None
    zs = [m_["zs_class_correct"] for m_ in per_client]
    zs_correct = None if any(z is None for z in zs) else np.sum(zs, axis=0)
    return with_longtail(exp, m, correct, total, zs_correct)


def zero_shot_cached(exp: Experiment, params: Params, idx: np.ndarray) -> np.ndarray | None:
    """The build's cached zero-shot logits of test samples `idx` (`zero_shot_test`) where the
    model on `params` (GM's or a client's PM tensors) provably is that zero-shot model, so that
    scoring it needs no forward (round 0, issue 50); None where it may not be. Provably: LoRA whose
    every B is zero (ΔW = B·A = 0: the LoRA branch adds exact zeros) and nothing else trainable
    but a head, every tensor at the values the cache was computed with (no warm start, no
    PRIVATE state yet), no PM rule of the method's own, class logits, frozen work cached
    (runtime.cache). The logits then differ from a forward only by the batches' rounding."""
    c, r = exp.cfg, exp.recipe
    if (c.peft.type != "lora" or not c.runtime.cache or r.prior or "zero_shot_test" not in exp.caches
            or c.model.task not in ("dual_encoder", "encoder_head")
            or (r.personalize is not None and r.personalize.predict is not None)
            or params.keys() != exp.init_params.keys()
            or not all(torch.equal(t, exp.init_params[n]) for n, t in params.items())):  # after round 0: fails fast
        return None
    infos = exp.model.param_infos()
    if any((i.factor is None and i.kind != "head") or (i.factor == "B" and params[n].any())  # beside LoRA; ΔW != 0
           for n, i in infos.items()):
        return None
    cached: np.ndarray = exp.caches["zero_shot_test"][torch.as_tensor(idx)].numpy()
    return cached


def logits_on(exp: Experiment, params: Params, idx: np.ndarray) -> np.ndarray:
    """The model on `params`: its logits on test samples `idx` (the cached zero-shot ones where it
    provably is the zero-shot model: zero_shot_cached)."""
    cached = zero_shot_cached(exp, params, idx)
    if cached is not None:
        return cached
    exp.model.load_params(params)
    logits: np.ndarray = exp.model.predict([exp.data.test_texts[i] for i in idx], exp.cfg.eval.batch_size).numpy()
    return logits


def evaluate_global(exp: Experiment, global_params: Params) -> Metrics:
    """GM: GLOBAL tensors + fresh PRIVATE ones on the balanced global test set (the first
    global_test_size test samples; a scenario's transformed local test copies follow it)."""
    d = exp.data
    size = d.global_test_size
    if _answers(exp):  # free-text answers: GLOBAL + fresh PRIVATE tensors on the global test records
        exp.model.load_params({**global_params, **{n: exp.init_params[n] for n in exp.private_names}})
        return answer_scores(exp, d.test_texts[:size])
    if exp.recipe.prior:  # a prior reference (majority, local-prior): the pooled prior, no model
        logits = prior_logits(exp, exp.train_ids, size)
    else:
        fresh = {n: exp.init_params[n] for n in exp.private_names}
        logits = logits_on(exp, {**global_params, **fresh}, np.arange(size))
    m = score(exp, d.test_labels[:size], logits, np.arange(size))
    return with_longtail(exp, m, m["class_correct"], m["class_total"], m["zs_class_correct"])


def _distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], names: Iterable[str]) -> float:
    return float(sum(float((a[n].float() - b[n].float()).pow(2).sum()) for n in names) ** 0.5)


def movement(exp: Experiment, global_params: Params, store: Store) -> dict[str, float | None]:
    """How far training moved the tensors from where they started (L2 norms of the change):
    GLOBAL (the final aggregate), PRIVATE and the model tensors of a method's slot, e.g. FedPuReL's
    residual branch (mean over the training clients
    whose state `store` holds; None where it holds none, as on Flower, whose clients keep theirs)."""
    out = {"global": _distance(global_params, exp.init_params, exp.global_names) if exp.global_names else None}
    states = [s for s in (ClientState.from_store(store.get(c)) for c in exp.train_ids) if s is not None]
    for key, slot in (("private", "params"), ("branch", "method")):
        # a method's slot may hold more than model tensors (HetLoRA: a rank): its model tensors only,
        # at the top or in a dict field of its state ("<field>/<tensor name>": FedPuReL's branch)
        held = [{n: t for k, t in getattr(s, slot).items() for n in (k, k.split("/", 1)[-1]) if n in exp.init_params}
                for s in states]
        per = [_distance(h, exp.init_params, h) for h in held if h]
        out[key] = sum(per) / len(per) if per else None
    return out


def check_groups(groups: Sequence[tuple[object, np.ndarray]] | None, n: int) -> None:
    """ClientOps.test_logits' groups (if any): every position of the n test samples in exactly one."""
    if groups is None:
        return
    seen = np.concatenate([np.asarray(m, dtype=np.int64).reshape(-1) for _, m in groups]) if groups else np.zeros(0)
    if len(seen) != n or not np.array_equal(np.sort(seen), np.arange(n)):
        raise ValueError(f"ClientOps.test_logits: groups must hold each of the {n} test positions exactly once")
