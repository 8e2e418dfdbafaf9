"""Reference recipes' clients. A pooled recipe (centralized) trains one stand-in client that
holds every training client's data (`prepare_reference`), for as many steps a round as a
federated round's clients take together (`pooled_budget`); a prior recipe (majority,
local-prior) needs the pooled training labels here."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Protocol

import numpy as np

from fedsplice.algorithms.references import check_pooled, check_prior
from fedsplice.data.partition import Client

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


def check_reference(cfg: ExperimentConfig, recipe: Recipe) -> None:
    """A reference recipe's requirements (checked by the plan, before weights load: federation.plan),
    for any method with such a recipe (the built-in references declare them too, so `validate`
    refuses them before the skeleton): a pooled one trains alone (`check_pooled`); a prior one
    needs the pooled training labels (`check_prior`)."""
    if recipe.prior:
        check_prior(cfg)
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
