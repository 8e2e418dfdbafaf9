"""Client tasks: every client-side stage, run where the client's data and PRIVATE state are.

A runtime moves a task's name, the client ids and the serialized GLOBAL tensors to whoever
holds those clients (this process in simulation, a SuperNode on Flower) and calls `run_task`
there; nothing of a client's data or PRIVATE tensors ever comes back, only what the task
returns. The tasks:

- `fit`          one round of local training; returns the GLOBAL upload (and keeps PRIVATE state):
                 `fedsplice.federation.fitting`, from this module's parts
- `evaluate`     the personalized model (GLOBAL + the client's PRIVATE) on its local test set
- `personalize`  the recipe's local stage after the rounds (FedPuReL phase 2)
- `cold_start`   a held-out client adapts the final GLOBAL tensors for 1..N local epochs
- `evaluate_global`  the global model on its local test set, with confusion counts (GM on the
                 sites, for per-site data when the server has no test set of its own)

All training goes through `train_client`: load params -> seed -> the one training loop.

References (`fedsplice.algorithms.references`) use the same tasks: a pooled recipe (centralized)
trains one stand-in client that holds every training client's data (`fedsplice.federation.pooled`),
and a prior recipe (majority, local-prior) scores constant log-prior logits in `evaluate`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

from fedsplice.algorithms import Personal, Phase, clone
from fedsplice.algorithms.state import fresh as fresh_state
from fedsplice.algorithms.state import unpack
from fedsplice.algorithms.switches import SWITCHES, chain
from fedsplice.core import streams
from fedsplice.core.context import TrainContext
from fedsplice.federation.dpsgd import session as dpsgd_session
from fedsplice.federation.evaluation import check_groups, logits_on, prior_logits, score
from fedsplice.federation.generative import scores as answer_scores
from fedsplice.federation.metrics import classification_metrics
from fedsplice.federation.pooled import pooled_budget
from fedsplice.federation.state import ClientState
from fedsplice.federation.train import PLAIN, Step, local_train, planned_steps

if TYPE_CHECKING:
    from fedsplice.algorithms import Link, Recipe
    from fedsplice.algorithms.hooks import After, Around, ModelFn, Objective, Scores
    from fedsplice.config import ClientConfig, ExperimentConfig
    from fedsplice.core.server import Params
    from fedsplice.data.datasets import TextDataset
    from fedsplice.data.partition import Client
    from fedsplice.federation.dpsgd import LocalDP
    from fedsplice.federation.experiment import Experiment
    from fedsplice.federation.metrics import Metrics
    from fedsplice.federation.store import Store

# the tasks `run_task` serves (fit has its own reply)
TASKS = ("evaluate", "personalize", "cold_start", "evaluate_global")


def split_state(exp: Experiment, state: ClientState | None) -> tuple[Params, Params]:
    """(PRIVATE tensors, their optimizer state) from a client's stored state (None: fresh)."""
    if state is None:
        return {n: exp.init_params[n].clone() for n in exp.private_names}, {}
    return state.params, state.opt


class Training(Protocol):
    """What `train_context` reads of an Experiment (benchmarks/flower_tutorial.py gives it a namespace)."""

    cfg: ExperimentConfig
    data: TextDataset
    clients: list[Client]
    recipe: Recipe
    caches: dict[str, Any]


def train_context(exp: Training, cid: int, links: Iterable[Link] = (), **extra: Any) -> TrainContext:
    """What the objective and loss terms may read (fedsplice.core.context): the task loss of the
    switches' `links`, and `extra` (round, the method's state)."""
    return TrainContext(client=cid, split=exp.recipe.split, task_loss=chain(list(links)), **extra)


def start_switches(exp: Experiment, cid: int, stored: ClientState | None,
                   received: Mapping[str, torch.Tensor]) -> dict[str, Link]:
    """Each of the config's switches, started on client `cid` from what the client kept of it
    (`stored`, None: fresh) and the GLOBAL tensors received: {name: its Link}, in chain order."""
    ops = OnClient(exp, cid)
    return {name: SWITCHES[name].start(params, ops, stored.kept_by(name) if stored is not None else {}, received)
            for name, params in exp.switches.items()}


def method_state(exp: Experiment, stored: ClientState | None) -> object:
    """The method's client state (Recipe.state), unpacked from what the client stored (None: fresh)."""
    return fresh_state(exp.recipe.state) if stored is None else unpack(exp.recipe.state, stored.method)


def train_client(exp: Experiment, cid: int, *, rnd: int, torch_round: int, ctx: TrainContext, step: Step = PLAIN,
                 keep_opt: Iterable[str] = frozenset(), opt_state: Mapping[str, torch.Tensor] | None = None,
                 client_cfg: ClientConfig | None = None, epochs: int | None = None,
                 private: LocalDP | None = None) -> tuple[Params, dict[str, float]]:
    """The one client driver: seed, then the one training loop on client `cid`'s training data,
    from the parameters already loaded into the model. `rnd` keys the client's data-order stream,
    `torch_round` its dropout seed (both from `streams`); `private`: DP-SGD (federation.dpsgd)."""
    c, d = exp.clients[cid], exp.data
    streams.seed_torch(exp.cfg, torch_round, cid)
    return local_train(
        exp.model, [d.train_texts[i] for i in c.train_idx], d.train_labels[c.train_idx],
        cfg=client_cfg or exp.cfg.client, step=step, ids=c.train_idx, keep_opt=set(keep_opt), opt_state=opt_state or {},
        rng=streams.rng(exp.cfg, streams.CLIENT, rnd, cid), ctx=ctx, epochs=epochs, private=private)


def round_phases(exp: Experiment, rnd: int) -> list[Phase]:
    """recipe.phases for round `rnd` (a function of the round, or the same every round)."""
    phases = exp.recipe.phases
    return [Phase(*p) for p in (phases(rnd) if callable(phases) else phases)]


def phase_budgets(exp: Experiment, cid: int, client_cfg: ClientConfig,
                  phases: list[Phase]) -> list[tuple[int, ClientConfig]]:
    """(epochs, client config) of each phase: its own epochs, or (recipe.phases_share_budget) a
    share of one local budget, k_i steps in proportion to its epochs (the remainder to the first
    phases), with the loop cut at k_i steps; a phase with no step is skipped (epochs 0)."""
    if not exp.recipe.phases_share_budget:
        return [(p.epochs, client_cfg) for p in phases]
    n = len(exp.clients[cid].train_idx)
    total, per_epoch = planned_steps(n, client_cfg, None), -(-n // client_cfg.batch_size)
    w = [p.epochs for p in phases]
    ks = [total * e // sum(w) for e in w]
    for i in range(total - sum(ks)):
        ks[i] += 1
    return [(-(-k // per_epoch), dataclasses.replace(client_cfg, max_steps=k)) if k else (0, client_cfg) for k in ks]


def train_phases(exp: Experiment, cid: int, **kw: Any) -> tuple[Params, dict[str, float]]:  # kw: train_client's
    """`train_client`, or, with recipe.phases (pFedLoRA), one call per phase on only that split
    group's tensors (the others frozen) for its epochs (`phase_budgets`). Statistics: the last
    phase's, with each phase's loss and steps as `<group>_loss`, `<group>_steps`; the kept
    optimizer state of all."""
    phases = round_phases(exp, kw["rnd"])
    if not phases:
        return train_client(exp, cid, **kw)
    params, split = exp.model.trainable(), exp.recipe.split
    opt: Params = {}
    stats: dict[str, float] = {}
    per: dict[str, float] = {}
    state = kw.pop("opt_state", None) or {}
    budgets = phase_budgets(exp, cid, kw.pop("client_cfg", None) or exp.cfg.client, phases)
    try:
        for (group, _, around), (epochs, ccfg) in zip(phases, budgets):
            if epochs == 0:
                per[f"{group}_steps"] = 0  # no loss to report (statistics are finite numbers)
                continue
            for n, p in params.items():
                p.requires_grad_(split[n] == group)
            mine = {k: v for k, v in state.items() if split[k.rsplit("/", 1)[0]] == group}
            with around(exp.model) if around else nullcontext():
                o, stats = train_client(exp, cid, **kw, opt_state=mine, epochs=epochs, client_cfg=ccfg)
            opt.update(o)
            per.update({f"{group}_loss": stats.get("loss", float("nan")), f"{group}_steps": stats["steps"]})
    finally:
        for p in params.values():
            p.requires_grad_(True)
    return opt, {**stats, **per}


def round_config(exp: Experiment, cid: int, rnd: int) -> ClientConfig:
    """The client config of round `rnd`: the pooled budget for a pooled recipe, and the round's
    lr under client.schedule (cosine annealing over server.rounds)."""
    cc = pooled_budget(exp, cid) if exp.recipe.pooled else exp.cfg.client
    return dataclasses.replace(cc, lr=cc.lr_at(rnd, exp.cfg.server.rounds))


def predict_local_test(exp: Experiment, cid: int) -> np.ndarray:
    d, idx = exp.data, exp.clients[cid].test_idx
    return exp.model.predict([d.test_texts[i] for i in idx], exp.cfg.eval.batch_size).numpy()


def evaluate(exp: Experiment, store: Store, cid: int, global_params: Params) -> Metrics:
    """One client's personalized model (GLOBAL + its PRIVATE tensors) on its local test set; for
    a prior recipe, without the model, the log class prior of the pooled training labels
    ("global") or of the client's own ("local")."""
    idx = exp.clients[cid].test_idx
    if exp.recipe.prior:
        logits = prior_logits(exp, [cid] if exp.recipe.prior == "local" else exp.train_ids, len(idx))
        return score(exp, exp.data.test_labels[idx], logits, idx)
    stored = ClientState.from_store(store.get(cid))
    priv, _ = split_state(exp, stored)
    stage = exp.recipe.personalize
    if stage and stage.predict:  # the method's own PM (on generate its test_logits are the scores)
        out = stage.predict(OnClient(exp, cid), {**global_params, **priv}, method_state(exp, stored))
        return (cast("Scores", out) if exp.cfg.model.task == "generate"
                else score(exp, exp.data.test_labels[idx], cast(np.ndarray, out), idx))
    if exp.cfg.model.task == "generate":  # free-text answers (fedsplice.federation.generative)
        exp.model.load_params({**global_params, **priv})
        return answer_scores(exp, [exp.data.test_texts[i] for i in idx])
    return score(exp, exp.data.test_labels[idx], logits_on(exp, {**global_params, **priv}, idx), idx)


@dataclass
class OnClient:
    """`ClientOps` (fedsplice.algorithms.recipe) on client `cid`: what a method's Personal hooks
    may do here, with this client's data and model."""

    exp: Experiment
    cid: int

    @property
    def num_classes(self) -> int:
        return len(self.exp.data.class_names)

    def labels(self) -> np.ndarray:
        labels: np.ndarray = self.exp.data.train_labels[self.exp.clients[self.cid].train_idx]
        return labels

    def logits(self, params: Mapping[str, torch.Tensor], texts: list[str]) -> torch.Tensor:
        self.exp.model.load_params(params)
        return self.exp.model.predict(texts, self.exp.cfg.eval.batch_size)

    def fresh(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.exp.init_params.items()}

    def test_logits(self, params: Mapping[str, torch.Tensor],
                    groups: Sequence[tuple[Around, np.ndarray]] | None = None) -> np.ndarray | Scores:
        exp = self.exp
        exp.model.load_params(params)
        idx = exp.clients[self.cid].test_idx
        check_groups(groups, len(idx))
        if exp.cfg.model.task == "generate":  # free-text answers: the scores, not logits
            return answer_scores(exp, [exp.data.test_texts[i] for i in idx], groups)
        if groups is None:
            return predict_local_test(exp, self.cid)
        out = np.zeros((len(idx), len(exp.data.class_names)), dtype=np.float32)
        for around, members in groups:
            with around(exp.model):
                out[members] = exp.model.predict([exp.data.test_texts[idx[i]] for i in members],
                                                 exp.cfg.eval.batch_size).numpy()
        return out

    def run(self, params: Mapping[str, torch.Tensor], on: str, fn: ModelFn) -> torch.Tensor:
        exp, d, c = self.exp, self.exp.data, self.exp.clients[self.cid]
        if on not in ("test", "train"):
            raise ValueError(f"ClientOps.run: on must be 'test' or 'train', got {on!r}")
        texts = [d.test_texts[i] for i in c.test_idx] if on == "test" else [d.train_texts[i] for i in c.train_idx]
        exp.model.load_params(params)
        with torch.no_grad():
            return fn(exp.model, texts, exp.cfg.eval.batch_size)

    def rng(self, key: int) -> np.random.Generator:
        return streams.rng(self.exp.cfg, streams.METHOD, self.cid, key)

    def sample_ids(self) -> np.ndarray:
        ids: np.ndarray = self.exp.clients[self.cid].train_idx
        return ids

    def cached(self, key: str, fn: ModelFn) -> torch.Tensor | None:
        exp = self.exp
        if not exp.cfg.runtime.cache:
            return None
        if (k := f"method/{key}") not in exp.caches:  # once per process, the whole training set
            with torch.no_grad():
                exp.caches[k] = fn(exp.model, exp.data.train_texts, exp.cfg.eval.batch_size)
        rows: torch.Tensor = exp.caches[k][torch.as_tensor(self.sample_ids())]
        return rows

    def train_logits(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        exp, d, c = self.exp, self.exp.data, self.exp.clients[self.cid]
        exp.model.load_params(params)
        table = torch.zeros(len(d.train_texts), len(d.class_names))
        table[torch.as_tensor(c.train_idx)] = exp.model.predict([d.train_texts[i] for i in c.train_idx],
                                                                exp.cfg.eval.batch_size)
        return table

    def train(self, params: Mapping[str, torch.Tensor], objective: Objective, rounds: range, *,
              client: Mapping[str, Any], **ctx: Any) -> dict[str, torch.Tensor]:
        exp, cid = self.exp, self.cid
        exp.model.load_params(params)
        ccfg = dataclasses.replace(exp.cfg.client, **client)
        opt: Params = {}
        for r in rounds:  # a stage's own stream keys: never those of the rounds' training
            opt, _ = train_client(exp, cid, rnd=streams.PERSONALIZE_ROUND + r,
                                  torch_round=streams.PERSONALIZE_TORCH_ROUND - r,
                                  ctx=train_context(exp, cid, **ctx), client_cfg=ccfg,
                                  step=Step(objective), keep_opt=set(params), opt_state=opt)
        return clone(exp.model.trainable())


def personalize(exp: Experiment, store: Store, cid: int, global_params: Params) -> Metrics:
    """The method's own stage after the rounds (recipe.personalize.after: FedPuReL's phase 2),
    scored on the local test set."""
    c = exp.clients[cid]
    stored = ClientState.from_store(store.get(cid))
    stage = cast(Personal, exp.recipe.personalize)  # the task of a recipe with personalize.after only
    logits = cast("After", stage.after)(OnClient(exp, cid), global_params, method_state(exp, stored))
    return score(exp, exp.data.test_labels[c.test_idx], logits, c.test_idx)


def cold_start(exp: Experiment, store: Store, cid: int, global_params: Mapping[str, torch.Tensor]) -> Metrics:
    """A held-out client: the final GLOBAL tensors (through the method's download rule, if it
    has one) and fresh PRIVATE ones; accuracy on its local test set at step 0 and after each of
    1..N local epochs (PFAdapter §V)."""
    fresh = {n: exp.init_params[n].clone() for n in exp.private_names}
    links = start_switches(exp, cid, None, global_params)
    ex, slot = exp.recipe.exchange, fresh_state(exp.recipe.state)
    if ex and ex.receive:  # a new client receives what a training client would (HetLoRA: its rank)
        global_params, slot = ex.receive(OnClient(exp, cid), 0, global_params, slot)
    exp.model.load_params({**global_params, **fresh})
    labels, r = exp.data.test_labels[exp.clients[cid].test_idx], exp.recipe
    accs: list[float] = []
    opt_state: Params = {}
    private = dpsgd_session(exp, cid, streams.COLD_START_ROUND)  # its data is protected as a training client's
    for e in range(exp.cfg.eval.cold_start_epochs + 1):
        if e > 0:
            opt_state, _ = train_client(
                exp, cid, rnd=streams.COLD_START_ROUND + e, torch_round=-e,
                ctx=train_context(exp, cid, links.values(), state=slot), private=private,
                step=Step.of(r), keep_opt=set(exp.model.trainable()), opt_state=opt_state, epochs=1)
        accs.append(classification_metrics(labels, predict_local_test(exp, cid), len(exp.data.class_names))["accuracy"])
    return {"accuracy": accs}


def evaluate_global(exp: Experiment, store: Store, cid: int, global_params: Params) -> Metrics:
    """The global model (GLOBAL + fresh PRIVATE tensors, as GM) on the client's local test set,
    with its confusion counts: GM evaluated on the sites when the server holds no test set
    (per-site data); only counts and metrics leave."""
    idx = exp.clients[cid].test_idx
    fresh = {n: exp.init_params[n] for n in exp.private_names}
    exp.model.load_params({**global_params, **fresh})
    logits = predict_local_test(exp, cid)
    labels, c = exp.data.test_labels[idx], len(exp.data.class_names)
    confusion = np.zeros((c, c), dtype=np.int64)
    np.add.at(confusion, (labels, logits.argmax(1)), 1)
    return {**score(exp, labels, logits, idx), "confusion": confusion.tolist()}


# runtimes call run_task
RUN: dict[str, Callable[[Experiment, Store, int, Params], Metrics]] = {
    "evaluate": evaluate, "personalize": personalize, "cold_start": cold_start, "evaluate_global": evaluate_global}


def run_task(task: str, exp: Experiment, store: Store, cid: int, global_params: Params) -> Metrics:
    """Run client task `task` (one of TASKS) for client `cid`; what it returns is all that leaves."""
    if task not in RUN:
        raise ValueError(f"unknown client task {task!r}; one of {', '.join(TASKS)}")
    return RUN[task](exp, store, cid, global_params)


def accepts(exp: Experiment, task: str, cid: int) -> bool:
    """Whether `cid` may be given `task`: cold start is for held-out clients, the rest for training ones."""
    return cid in (exp.holdout_ids if task == "cold_start" else exp.train_ids)
