"""Federation: one experiment's clients, the client tasks, the one training loop, the one round
loop, evaluation, the client-state store and checkpoints. Runtimes use only the names below.

- `experiment`: `build(cfg) -> Experiment` (data, clients, model, recipe, server optimizer).
- `tasks`: the client tasks (fit, evaluate, personalize, cold_start): every client-side stage;
  `fitting`: the fit task's start and end around its training.
- `batched`, `batched_train`: many clients through one base model (runtime.batch_eval,
  runtime.batch_train; `batching`: where they apply).
- `train`: the one local training loop (random streams: `fedsplice.core.streams`).
- `rounds`: the round loop and the stages after it, over any transport; `calls`: its calls of
  the transport, seen by the run's `Observer` (the progress display).
- `evaluation`, `metrics`: GM, PM and the long-tail metrics. `gather`: one round's replies.
- `store`, `checkpoint`: PRIVATE state per client; resumable server state.
- `validate`: config checks across sections (algorithm, server, zoo, data set names).
- `ledger`: what each client sent and what the server received, per tensor (`fedsplice audit`);
  `privacy`: DP-FedAvg's clipping, noise and ε.
"""

import tomllib

from fedsplice.config import SITES, ExperimentConfig, from_dict
from fedsplice.core import wire
from fedsplice.core.robust import check_update
from fedsplice.core.streams import FAULTS, rng
from fedsplice.federation import ledger
from fedsplice.federation.batched import evaluate as evaluate_batched
from fedsplice.federation.batched_train import fit_together
from fedsplice.federation.calls import Observer
from fedsplice.federation.evaluation import movement, references
from fedsplice.federation.experiment import Client, Experiment, build
from fedsplice.federation.fitting import fit as fit_client
from fedsplice.federation.gather import Secured
from fedsplice.federation.ledger import masked_rows, site_masked
from fedsplice.federation.rounds import (
    Reply,
    Transport,
    cold_start,
    evaluate_only,
    gm_and_pm,
    personalization,
    run_rounds,
)
from fedsplice.federation.store import DiskStore, Store, make_store
from fedsplice.federation.tasks import TASKS, accepts
from fedsplice.federation.tasks import run_task as client_task
from fedsplice.federation.validate import load_config
from fedsplice.federation.validate import validate as validate_config

__all__ = ["Client", "DiskStore", "Experiment", "FAULTS", "Observer", "Reply", "SITES", "Secured", "Store", "TASKS",
           "evaluate_batched", "fit_together",
           "Transport", "accepts", "build", "check_update", "client_task", "cold_start", "config_from_text",
           "evaluate_only", "fit_client", "gm_and_pm", "ledger", "load_config", "make_store", "masked_rows",
           "movement", "personalization", "references", "rng", "run_rounds", "site_masked", "validate_config",
           "wire"]


def config_from_text(text: str) -> ExperimentConfig:
    """An ExperimentConfig from resolved TOML text (a run config on the wire), validated in full."""
    return validate_config(from_dict(ExperimentConfig, tomllib.loads(text)))
