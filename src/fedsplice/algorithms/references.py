"""Reference rows: what a table needs next to the methods to tell whether their numbers are sane.

- `centralized` (the usual upper reference): one PEFT of the config's `peft.type`, every tensor
  GLOBAL, trained on the POOLED training data of all training clients. Each round the pooled
  data train one model alone (`Recipe.pooled`: the federation runs it as the `fit` task of one
  stand-in client, id `data.num_clients`, that holds the union of the training clients' data), for
  the local budget of the `server.clients_per_round` clients a federated round trains: as many
  optimizer steps of `client.batch_size` as those clients take together on average,
  clients_per_round × mean over training clients of min(client.max_steps,
  client.local_epochs·⌈n_k / batch⌉), on a fresh shuffle of the pooled data every round. The
  optimizer (`client.optimizer`, `client.lr`) keeps its state across rounds: one continuous
  training run, evaluated after every round. No aggregation (one model, no server step) and no
  traffic: results report 0 bytes. GM: the model on the global test set; PM: the same model on
  every client's local test set. Held-out clients still run cold start from it.
- `majority`: predicts the global majority class of the pooled training labels (of the
  training clients) for every input, in GM and PM. No training, no traffic.
- `local-prior`: PM: each client predicts its own majority training class on its local test
  set; GM: the global majority class (a global model has no client to take a prior from).
  No training, no traffic.

The two priors never run the model: their logits are the constant log class prior (ties go to
the lowest class index), scored by the same evaluation code as every method (accuracy, F1,
AUC, many/medium/few, balancedness); `tkl` and `head_bias`, which compare with the zero-shot
model's predictions, are not reported for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedsplice.algorithms.recipe import Algorithm, ModelSpec, NoParams, Recipe, no_server_step
from fedsplice.config import SITES
from fedsplice.core import split as S
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from fedsplice.config import ExperimentConfig


def check_pooled(cfg: ExperimentConfig) -> None:
    """A pooled recipe trains one model on data gathered in one place: refuse what only a
    federation has (a deployment, a server step, codecs, failing or rejected clients). The plan
    runs it for any pooled recipe (federation.pooled.check_reference); centralized declares it."""
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


def check_prior(cfg: ExperimentConfig) -> None:
    """A prior reads the pooled training labels, which per-site data keep on the sites."""
    if cfg.data.dataset == SITES:
        raise ConfigError(f"algorithm {cfg.algorithm!r} predicts from the pooled training labels, which "
                          f"data.dataset = 'sites' keeps on the sites; use a data set the server can read")


def centralized(p: NoParams, spec: ModelSpec) -> Recipe:
    return Recipe(S.all_global(spec.infos), pooled=True)


def majority(p: NoParams, spec: ModelSpec) -> Recipe:
    return Recipe(S.none_global(spec.infos), trains=False, prior="global")


def local_prior(p: NoParams, spec: ModelSpec) -> Recipe:
    return Recipe(S.none_global(spec.infos), trains=False, prior="local")


REFERENCES: dict[str, Algorithm] = {
    "centralized": Algorithm(
        NoParams, centralized,
        "reference: one PEFT (all tensors) trained on the pooled data of all training clients, "
        "clients_per_round x a client's local steps per round; no aggregation, no traffic",
        check_config=lambda p, cfg: check_pooled(cfg), full_ok=True, label=no_server_step),
    "majority": Algorithm(
        NoParams, majority,
        "reference: predicts the pooled training data's majority class everywhere; no training, no traffic",
        check_config=lambda p, cfg: check_prior(cfg), full_ok=True, label=no_server_step),
    "local-prior": Algorithm(
        NoParams, local_prior,
        "reference: PM predicts each client's own majority training class, GM the global one; "
        "no training, no traffic", check_config=lambda p, cfg: check_prior(cfg), full_ok=True,
        label=no_server_step),
}
