"""Reference recipes' clients. A pooled recipe (centralized) trains one stand-in client that
holds every training client's data (`prepare_reference`), for as many steps a round as a
federated round's clients take together (`pooled_budget`); a prior recipe (majority,
local-prior) needs the pooled training labels here."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Protocol

import numpy as np

from fedsplice.config import SITES
from fedsplice.data.partition import Client
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from fedsplice.algorithms import Recipe
    from fedsplice.config import ClientConfig, ExperimentConfig
    from fedsplice.data.datasets import TextDataset


class Pooling(Protocol):
    """What a reference recipe reads and sets of an Experiment (federation.experiment imports this module)."""

    cfg: ExperimentConfig
    recipe: Recipe
    data: TextDataset
    clients: list[Client]
    train_ids: list[int]
    sampling: list[list[int]]


def check_pooled(cfg: ExperimentConfig) -> None:
    """A pooled recipe trains one model on data gathered in one place: refuse what only a
    federation has (a deployment, a server step, codecs, failing or rejected clients)."""
    s, f = cfg.server, cfg.faults
    for wrong, need in ((cfg.runtime.kind != "simulation", "runtime.kind = 'simulation'"),
                        (s.optimizer != "fedavg" or s.lr not in (0.0, 1.0),
                         "server.optimizer = 'fedavg' (server.lr 0)"),
                        (s.min_replies != 1, "server.min_replies = 1"),
                        (s.update_norm_bound > 0, "server.update_norm_bound = 0"),
                        (cfg.client.upload != "fp32", "client.upload = 'fp32'"),
                        (f.dropout > 0 or f.straggler > 0, "faults.dropout = faults.straggler = 0")):
        if wrong:
            raise ConfigError(f"algorithm {cfg.algorithm!r} trains one model on the pooled data of all training "
                              f"clients (nothing is federated): it needs {need}")


def check_reference(cfg: ExperimentConfig, recipe: Recipe) -> None:
    """A reference recipe's requirements (checked by the plan, before weights load: federation.plan):
    a pooled one trains alone (`check_pooled`); a prior one needs the pooled training labels,
    which per-site data keep on the sites."""
    if recipe.prior and cfg.data.dataset == SITES:
        raise ConfigError(f"algorithm {cfg.algorithm!r} predicts from the pooled training labels, which "
                          f"data.dataset = 'sites' keeps on the sites; use a data set the server can read")
    if recipe.pooled:
        check_pooled(cfg)


def prepare_reference(exp: Pooling) -> None:
    """A reference recipe at build time. Pooled (centralized): a stand-in client, id
    data.num_clients, holds the union of the training clients' data (its test set: the global
    one) and trains alone in every round; it is not a training client (PM is still scored on
    every client in `exp.train_ids`). Prior (majority, local-prior): the pooled training labels
    must be here, which per-site data never gather (`check_reference`, run by the plan)."""
    if not exp.recipe.pooled:
        return
    cid = len(exp.clients)
    pooled = np.sort(np.concatenate([exp.clients[k].train_idx for k in exp.train_ids]))
    exp.clients.append(Client(cid, pooled, np.arange(exp.data.global_test_size)))
    exp.sampling = [[cid] for _ in exp.sampling]


def pooled_budget(exp: Pooling, cid: int) -> ClientConfig:
    """The pooled model's client config for one round: as many steps of client.batch_size as the
    server.clients_per_round clients of a federated round take together on average, i.e.
    clients_per_round × mean_k min(client.max_steps, client.local_epochs·⌈n_k/batch⌉) (rounded),
    over as many passes of the pooled data as that needs."""
    cc = exp.cfg.client
    per_client = [cc.local_epochs * math.ceil(len(exp.clients[k].train_idx) / cc.batch_size) for k in exp.train_ids]
    if cc.max_steps:
        per_client = [min(n, cc.max_steps) for n in per_client]
    steps = max(1, round(exp.cfg.server.clients_per_round * float(np.mean(per_client))))
    epoch = max(1, math.ceil(len(exp.clients[cid].train_idx) / cc.batch_size))
    return dataclasses.replace(cc, max_steps=steps, local_epochs=math.ceil(steps / epoch))
