"""Build everything one experiment needs from its config: data, clients, model, recipe, server.

Every random choice draws from its own explicitly seeded generator, so two algorithms run with
the same seed see the same partition, the same local test sets and the same sampled clients.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsplice.algorithms import Recipe, clone
from fedsplice.algorithms.switches import switch_params
from fedsplice.config import SITES, ExperimentConfig
from fedsplice.core.server import ServerOptimizer, make_server_optimizer
from fedsplice.core.streams import LOCAL_TEST, LONG_TAIL, PARTITION, SAMPLING, SCENARIO, VALIDATION, rng
from fedsplice.data import flowertune
from fedsplice.data import partition as P
from fedsplice.data.datasets import TextDataset, load_dataset
from fedsplice.data.hubdata import HubColumns
from fedsplice.data.instruct import natural_clients
from fedsplice.data.partition import Client as Client  # re-exported: fedsplice.federation.experiment.Client
from fedsplice.data.scenarios import apply_scenario
from fedsplice.data.sites import load_server_test, load_site
from fedsplice.data.testsets import disjoint_clients
from fedsplice.federation.generative import check_images, length_warnings_of
from fedsplice.federation.plan import check_loaded, plan
from fedsplice.federation.pooled import prepare_reference
from fedsplice.federation.privacy import Plan
from fedsplice.federation.privacy import plan as privacy_plan
from fedsplice.model.taskmodel import TaskModel


@dataclass
class Experiment:
    cfg: ExperimentConfig
    data: TextDataset
    clients: list[Client]
    train_ids: list[int]  # clients that take part in training
    holdout_ids: list[int]  # cold-start clients, never trained on during the run
    model: TaskModel
    recipe: Recipe
    global_names: list[str]
    private_names: list[str]
    init_params: dict[str, torch.Tensor]  # the fresh state of every trainable tensor
    server_opt: ServerOptimizer
    sampling: list[list[int]]  # pre-generated: round r trains clients sampling[r]
    caches: dict[str, Any] = field(default_factory=dict)  # frozen work; a method's: "method/<key>" (ClientOps.cached)
    switches: dict[str, Any] = field(default_factory=dict)  # the config's switches' typed tables, in chain order
    scenario: dict[str, Any] = field(default_factory=dict)  # realised scenario statistics (JSON); {}: none
    privacy: Plan | None = None  # [privacy] resolved (noise multiplier chosen); None: off
    # where this process's side writes the ledger of uploads (federation.ledger); None: no ledger
    ledger: Path | None = None
    batch_eval: bool = False  # PM scored for many clients in one pass (runtime.batch_eval, federation.batched)
    batch_train: bool = False  # a round's clients trained together (runtime.batch_train, federation.batched_train)
    batch_notes: tuple[str, ...] = ()  # the run's lines on those settings (plan.Plan.batch_notes)


def make_clients(cfg: ExperimentConfig, data: TextDataset, reserved: Collection[str] = ()) -> list[Client]:
    """Partition the training set; each client's local test set (data.local_test: from the global
    test set, or disjoint from unused items other than `reserved`, fedsplice.data.testsets)."""
    dc = cfg.data
    g = rng(cfg, PARTITION)
    if dc.partition == "natural":  # instruction records' own `client` field (model.task = "generate")
        _, parts, tests = natural_clients(data.train_texts, data.test_texts[:data.global_test_size], dc.num_clients)
        return [Client(k, np.asarray(p, dtype=np.int64), np.asarray(t, dtype=np.int64))
                for k, (p, t) in enumerate(zip(parts, tests))]
    if dc.partition == "iid":
        parts = P.iid_partition(data.train_labels, dc.num_clients, g)
    elif dc.partition == "shards":
        parts = P.shard_partition(data.train_labels, dc.num_clients, dc.shards_per_client, g)
    else:
        parts = P.dirichlet_partition(data.train_labels, dc.num_clients, dc.alpha, g)
    gt = rng(cfg, LOCAL_TEST)
    if disjoint_tests(cfg):
        return disjoint_clients(dc, data, parts, reserved, gt)
    c = len(data.class_names)
    global_labels = data.test_labels[:data.global_test_size]  # never a scenario's local copies
    return [Client(k, idx, P.local_test_indices(data.train_labels[idx], global_labels,
                                                 dc.local_test_size, c, gt))
            for k, idx in enumerate(parts)]


def sampling_stream(cfg: ExperimentConfig, train_ids: list[int]) -> list[list[int]]:
    g = rng(cfg, SAMPLING)
    m = cfg.server.clients_per_round
    return [sorted(int(c) for c in g.choice(train_ids, size=m, replace=False))
            for _ in range(cfg.server.rounds)]


def validation_draw(cfg: ExperimentConfig, data: TextDataset) -> np.ndarray:
    """The validation hold-out's training indices: one draw, whether it is evaluated on (tuning)
    or kept out of disjoint local test sets (a measured run)."""
    return P.validation_indices(data.train_labels, cfg.eval.validation_per_class, rng(cfg, VALIDATION))


def apply_validation(cfg: ExperimentConfig, data: TextDataset) -> TextDataset:
    """eval.on = "validation" (tuning): eval.validation_per_class training samples of each class
    become the evaluation set in place of the test set, which is then not read at all; the rest
    of the pipeline (long tail, partition, local test sets) runs on what is left."""
    if cfg.eval.on != "validation":
        return data
    val = validation_draw(cfg, data)
    keep = np.setdiff1d(np.arange(len(data.train_labels)), val)
    data.test_texts, data.test_labels = [data.train_texts[i] for i in val], data.train_labels[val]
    data.n_global_test = None
    data.train_texts, data.train_labels = [data.train_texts[i] for i in keep], data.train_labels[keep]
    if data.report:
        data.report.setdefault("notes", []).append(
            f"eval.on = validation: {len(val)} training samples ({cfg.eval.validation_per_class} a class at most) "
            f"are the evaluation set; the test set is not used")
    return data


def apply_long_tail(cfg: ExperimentConfig, data: TextDataset) -> TextDataset:
    """Cut the training set to the exponential profile: the largest available class first
    (data.long_tail_order = "size") or in a seeded permutation of the classes ("permuted")."""
    dc = cfg.data
    if dc.imbalance <= 1:
        return data
    counts = np.bincount(data.train_labels, minlength=len(data.class_names))
    g = rng(cfg, LONG_TAIL)
    if dc.long_tail_order == "permuted":
        order, n_max = P.permuted_order(counts, dc.imbalance, dc.n_max, g, data.class_names)
    else:
        order, n_max = np.argsort(-counts, kind="stable"), dc.n_max or int(counts.max())
    keep = P.long_tail_subsample(data.train_labels, n_max, dc.imbalance, g, class_order=order)
    if data.report:
        data.report["dropped"]["long_tail"] = len(data.train_labels) - len(keep)
    data.train_texts = [data.train_texts[i] for i in keep]
    data.train_labels = data.train_labels[keep]
    return data


def site_data(cfg: ExperimentConfig, site: tuple[str, int] | None) -> tuple[TextDataset, list[Client], dict[str, Any]]:
    """Per-site data (data.dataset = "sites"): on a SuperNode, `site` = (its data-path, its client
    id) and only that client has data; on the server (None), no client has any, and the global
    test set is the server's own evaluation file (data.test) or empty (GM on the sites)."""
    dc, empty = cfg.data, np.empty(0, np.int64)
    clients = [Client(k, empty, empty) for k in range(dc.num_clients)]
    if site is None:
        return load_server_test(dc.test, dc.labels, skip_bad_images=dc.skip_bad_images,
                                class_names=dc.class_names), clients, {}
    spec, cid = site
    data = load_site(spec, dc.labels, seed=cfg.seed, local_test_size=dc.local_test_size,
                     max_per_class=dc.max_per_class or None, skip_bad_images=dc.skip_bad_images,
                     class_names=dc.class_names)
    clients[cid] = Client(cid, np.arange(len(data.train_texts)), np.arange(len(data.test_texts)))
    return data, clients, {}


def build_data(cfg: ExperimentConfig,
               site: tuple[str, int] | None = None) -> tuple[TextDataset, list[Client], dict[str, Any]]:
    """The data part of `build`, without a model: the data set, split and long-tail cut; the
    clients; the realised scenario. `fedsplice validate` runs it to check the data. `site`:
    see `site_data`."""
    if cfg.data.dataset == SITES:
        return site_data(cfg, site)
    data, clients = split_data(cfg)
    if cfg.model.prompt_template == "flowertune":
        flowertune.check_single_turn(data.train_texts + data.test_texts)
    scenario = apply_scenario(cfg.scenario, data, clients, rng(cfg, SCENARIO), seed=cfg.seed)
    return data, clients, scenario


def disjoint_tests(cfg: ExperimentConfig) -> bool:
    """data.local_test = "disjoint" in a measured run. A validation run (tuning) draws its local
    validation sets from the hold-out as "global" does, in each client's training proportions: the
    unused items left once the measured run's test items are out cannot keep those proportions,
    and tuning scores are never reported. It trains on none of the measured run's test items, and
    the measured run's sets leave the hold-out out (`reserved_items`)."""
    return cfg.data.local_test == "disjoint" and cfg.eval.on != "validation"


def split_data(cfg: ExperimentConfig) -> tuple[TextDataset, list[Client]]:
    """The data set, its split, long-tail cut and validation hold-out, and the clients."""
    disjoint = disjoint_tests(cfg)
    data = load_dataset(cfg.data.dataset, seed=cfg.seed, test_per_class=cfg.data.test_per_class,
                        max_per_class=cfg.data.max_per_class or None, skip_bad_images=cfg.data.skip_bad_images,
                        class_names=cfg.data.class_names, test=cfg.data.test,
                        hub=HubColumns(cfg.data.hf_text, cfg.data.hf_image, cfg.data.hf_label, cfg.data.hf_train_split,
                                       cfg.data.hf_test_split), keep_pool=disjoint,
                        instructions=instruction_groups(cfg), record_format=cfg.data.record_format)
    reserved = reserved_items(cfg, data) if disjoint else set()
    data = apply_validation(cfg, data)
    if cfg.data.local_test == "disjoint" and not disjoint:  # a validation run: it never trains on a test item
        data = _within(data, set(split_data(replace(cfg, eval=replace(cfg.eval, on="test")))[0].train_texts))
    else:
        data = apply_long_tail(cfg, data)
    return data, make_clients(cfg, data, reserved)


def instruction_groups(cfg: ExperimentConfig) -> str | None:
    """The field instruction records are grouped by: data.group_field, or `client` for a natural
    partition (a carved test set then takes data.test_per_class records of every client); None:
    not instruction records."""
    if cfg.model.task != "generate":
        return None
    return "client" if cfg.data.partition == "natural" else cfg.data.group_field


def _within(data: TextDataset, texts: set[str]) -> TextDataset:
    """`data`'s training items that are in `texts`: a validation run trains on the measured run's
    training set (its long-tail cut included) less the hold-out. Its own cut could pick items the
    measured run's cut left unused, from which its disjoint test sets are drawn."""
    keep = np.array([i for i, t in enumerate(data.train_texts) if t in texts], dtype=np.int64)
    if data.report:
        data.report["dropped"]["long_tail"] = len(data.train_labels) - len(keep)
    data.train_texts, data.train_labels = [data.train_texts[i] for i in keep], data.train_labels[keep]
    return data


def reserved_items(cfg: ExperimentConfig, data: TextDataset) -> set[str]:
    """What disjoint local test sets must not take besides training and the global test set: the
    validation hold-out (the same draw as `apply_validation`), on which tuning evaluates."""
    return {data.train_texts[i] for i in validation_draw(cfg, data)}


def build(cfg: ExperimentConfig, site: tuple[str, int] | None = None) -> Experiment:
    """Everything a run needs; `site` = (data file, client id) on a per-site SuperNode."""
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    data, clients, scenario = build_data(cfg, site)
    if cfg.model.task == "generate":
        check_images(cfg, data)
    n_train = cfg.data.num_clients - cfg.data.holdout_clients
    train_ids, holdout_ids = list(range(n_train)), list(range(n_train, cfg.data.num_clients))
    class_prompt = cfg.data.class_prompt or data.class_prompt
    planned = plan(cfg, data.class_names, class_prompt)  # every combination check, before weights load
    model = TaskModel(cfg, data.class_names, class_prompt)
    check_loaded(planned, model)
    if cfg.model.task == "generate":
        data.report.setdefault("warnings", []).extend(length_warnings_of(cfg, model, data))
    server_opt = make_server_optimizer(cfg.server.optimizer, **cfg.server.optimizer_kwargs())
    exp = Experiment(cfg, data, clients, train_ids, holdout_ids, model, planned.recipe, planned.global_names,
                     planned.private_names, clone(model.trainable()), server_opt, sampling_stream(cfg, train_ids),
                     scenario=scenario, batch_eval=planned.batch_eval,
                     batch_train=planned.batch_train, batch_notes=planned.batch_notes)
    exp.privacy = privacy_plan(cfg, len(train_ids))
    exp.switches = switch_params(cfg)
    if planned.recipe.pooled or planned.recipe.prior:  # the reference rows: centralized's pooled client; checks
        prepare_reference(exp)
    exp.caches.update(zero_shot_caches(exp))
    return exp


def zero_shot_caches(exp: Experiment) -> dict[str, Any]:
    """Frozen work computed once: zero-shot logits of the test set (for TKL and head bias). None for a prior recipe
    (majority, local-prior): it never runs the model."""
    bs = exp.cfg.eval.batch_size
    out: dict[str, Any] = {}
    if not exp.recipe.prior and exp.cfg.model.task != "generate":  # generate: no class logits
        with exp.model.zero_shot():
            out["zero_shot_test"] = exp.model.predict(exp.data.test_texts, bs) if exp.data.test_texts else None
    if out.get("zero_shot_test") is None:
        out.pop("zero_shot_test", None)
    # per-site data: the server never sees a label, so no class counts (no many/medium/few)
    per_site_server = exp.cfg.data.dataset == SITES and not len(exp.data.train_labels)
    out["train_counts"] = None if per_site_server else np.bincount(exp.data.train_labels,
                                                                   minlength=len(exp.data.class_names))
    return out
