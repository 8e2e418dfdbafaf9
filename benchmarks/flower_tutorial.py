"""The baseline of the round-time benchmark: fedsplice's algorithm written the way Flower's
PEFT tutorials write it (flowertune, "Flower + HF transformers"), on Flower's simulation engine.

    python benchmarks/flower_tutorial.py configs/pfadapter-minilm.toml --rounds 2 [--set k=v ...]

prints one JSON line: rounds, seconds_total, seconds_per_round, gm_accuracy, pm_accuracy,
peak_rss_mb, up_bytes_per_round (and a few more).

Same experiment as `fedsplice run CONFIG`: the data, partition, sampled clients, seed, model and
local update all come from fedsplice (experiment.build, train.local_train with the recipe's
objective, loss terms and gradient transform, the same rng streams), so the accuracies are
comparable. What is "tutorial style" is everything around the math:
  - every ClientApp call builds a fresh model from the checkpoint (`get_model()`), re-tokenizes,
    and recomputes frozen work (runtime.cache=false: e.g. FedPuReL's zero-shot logits by an
    extra frozen forward every step);
  - GLOBAL tensors travel as ArrayRecords and Flower's stock FedAvg averages them (weighted by
    num-examples), which is fedsplice's fedavg with server lr 1 (only fedavg is supported here);
  - PRIVATE tensors and their AdamW moments live in the node's `context.state`;
  - GM is centralized evaluation in the ServerApp, PM is federated evaluation messages.
FedPuReL's phase 2 (local personalization) is not run: the PM reported is that of phase 1.
Cold start (held-out clients) is not run either.

Server side, only what stock FedAvg does: server.optimizer = fedavg, mean aggregation, fp32 uploads.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, NotRequired, TypedDict

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # Ray workers inherit the driver's environment
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from fedsplice.algorithms import ModelSpec, build_recipe, method_params  # noqa: E402
from fedsplice.config import ExperimentConfig  # noqa: E402
from fedsplice.core.split import GLOBAL, PRIVATE, names_in  # noqa: E402
from fedsplice.core.streams import CLIENT as STREAM_CLIENT  # noqa: E402
from fedsplice.core.streams import rng, seed_torch  # noqa: E402
from fedsplice.data.datasets import load_dataset  # noqa: E402
from fedsplice.federation.experiment import apply_long_tail, build, make_clients  # noqa: E402
from fedsplice.federation.metrics import classification_metrics  # noqa: E402
from fedsplice.federation.tasks import train_context  # noqa: E402
from fedsplice.federation.train import Step, local_train  # noqa: E402
from fedsplice.federation.validate import load_config  # noqa: E402
from fedsplice.model.taskmodel import TaskModel  # noqa: E402

if TYPE_CHECKING:
    from fedsplice.federation.experiment import Experiment


class Log(TypedDict):
    """What the server side records for the report (shared by the strategy and the GM function)."""

    gm: dict[int, float]  # round -> GM accuracy
    pm: dict[int, float]  # round -> PM accuracy
    round_s: list[float]
    round_wall_s: list[float]
    up_bytes: list[int]
    train_loss: list[float | None]
    client_setup_s: list[float]
    client_train_s: list[float]
    eval_s: float
    errors: list[str | None]  # the failed replies' reasons
    worker_rss_mb: float
    worker_threads: int | None
    t0: NotRequired[float]  # the running round's start
    te: NotRequired[float]  # the running evaluation's start


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def is_eval_round(cfg: ExperimentConfig, rnd: int) -> bool:
    return rnd % cfg.eval.every == 0 or rnd == cfg.server.rounds  # as simulation.run_rounds


def scalar(v: object) -> float:
    """A number a record carries, as it is (a record types its values as any scalar or list)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    raise TypeError(f"a record value {v!r}: want a number")


# ============================================================================ ClientApp side
# Like flowertune's `load_data`, the data set is loaded once per worker process (there it is the
# global FederatedDataset); everything derived from the model is rebuilt on every call.
_DATA: dict[str, SimpleNamespace] = {}


def load_data(cfg: ExperimentConfig) -> SimpleNamespace:
    """The data set and every client's indices, exactly as experiment.build makes them. The
    namespace has what tasks.train_context and streams.seed_torch read from an Experiment."""
    key = repr(cfg)
    if key not in _DATA:
        d = load_dataset(cfg.data.dataset, seed=cfg.seed, test_per_class=cfg.data.test_per_class,
                         max_per_class=cfg.data.max_per_class or None)
        d = apply_long_tail(cfg, d)
        _DATA[key] = SimpleNamespace(cfg=cfg, data=d, clients=make_clients(cfg, d), caches={})
    return _DATA[key]


def get_model(cfg: ExperimentConfig, class_names: list[str]):
    """A fresh model from the checkpoint, its recipe and its GLOBAL/PRIVATE names. Its LoRA init
    is seeded by cfg.seed, so its trainable tensors equal experiment.build's init_params."""
    model = TaskModel(cfg, class_names)
    params = model.trainable()
    spec = ModelSpec(model.param_infos(), {n: p.shape for n, p in params.items()}, model.scalings())
    recipe = build_recipe(cfg, spec)
    return model, recipe, names_in(recipe.split, GLOBAL), names_in(recipe.split, PRIVATE)


def load_private(context: Context) -> tuple[dict, dict]:
    """PRIVATE tensors and their optimizer state from the node's state; none (the fresh model
    keeps its init, a fresh optimizer its zero moments) when this client never trained."""
    st = context.state
    priv = st.array_records["private"].to_torch_state_dict() if "private" in st else {}
    opt = st.array_records["opt"].to_torch_state_dict() if "opt" in st else {}
    return priv, opt


def make_client_app(cfg: ExperimentConfig) -> ClientApp:
    # The handlers close over cfg: Ray pickles this app (by value) into its workers.
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        # The server asks once which partition (= fedsplice client id) a node holds.
        pid = int(context.node_config["partition-id"])
        return Message(RecordDict({"node": ConfigRecord({"partition-id": pid})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        t0 = time.perf_counter()
        cid = int(context.node_config["partition-id"])
        rnd = int(scalar(msg.content.config_records["config"]["server-round"]))
        lite = load_data(cfg)
        d, c = lite.data, lite.clients[cid]
        model, recipe, global_names, private_names = get_model(cfg, d.class_names)
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        priv, opt_state = load_private(context)
        model.load_params({**received, **priv})
        texts = [d.train_texts[i] for i in c.train_idx]
        # runtime.cache = false (above): no method state, so an objective that needs frozen work
        # (FedPuReL's zero-shot logits) runs an extra frozen forward per step.
        lite.recipe = recipe  # train_context reads the recipe's split (the term diagnostics use it)
        ctx = train_context(lite, cid, round=rnd)
        t1 = time.perf_counter()
        seed_torch(cfg, rnd, cid)  # as federation.fitting.fit: same dropout and data order
        new_opt, stats = local_train(
            model, texts, d.train_labels[c.train_idx], cfg=cfg.client, step=Step.of(recipe),
            ids=c.train_idx,
            keep_opt=set(private_names), opt_state=opt_state, rng=rng(cfg, STREAM_CLIENT, rnd, cid), ctx=ctx)
        params = model.trainable()
        # Stateful client, as Flower recommends: PRIVATE state stays in context.state.
        context.state["private"] = ArrayRecord.from_torch_state_dict({n: params[n] for n in private_names})
        context.state["opt"] = ArrayRecord.from_torch_state_dict(new_opt)
        metrics = MetricRecord({"num-examples": len(c.train_idx), "train-loss": float(stats["loss"]),
                                "setup-s": t1 - t0, "train-s": time.perf_counter() - t1,
                                "rss-mb": peak_rss_mb(), "threads": torch.get_num_threads()})
        arrays = ArrayRecord.from_torch_state_dict({n: params[n] for n in global_names})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        # PM: this client's personalized model (GLOBAL received + its PRIVATE) on its local test set.
        cid = int(context.node_config["partition-id"])
        lite = load_data(cfg)
        d, c = lite.data, lite.clients[cid]
        model, *_ = get_model(cfg, d.class_names)
        priv, _ = load_private(context)
        model.load_params({**msg.content.array_records["arrays"].to_torch_state_dict(), **priv})
        logits = model.predict([d.test_texts[i] for i in c.test_idx], cfg.eval.batch_size).numpy()
        acc = classification_metrics(d.test_labels[c.test_idx], logits, len(d.class_names))["accuracy"]
        return Message(RecordDict({"metrics": MetricRecord(
            {"accuracy": acc, "num-examples": len(c.test_idx), "rss-mb": peak_rss_mb()})}), reply_to=msg)

    return app


# ============================================================================ ServerApp side


class SampledFedAvg(FedAvg):
    """Flower's stock FedAvg; only whom it asks changes: round r trains exactly fedsplice's
    sampled clients exp.sampling[r-1], and evaluation asks every training client on eval rounds.
    It also records what the benchmark reports (time, bytes, the workers' RSS)."""

    def __init__(self, exp: Experiment, node_of: dict[int, int], log: Log) -> None:
        # PM is the plain mean over clients (fedsplice's definition), not weighted by test size.
        super().__init__(evaluate_metrics_aggr_fn=lambda contents, _key: MetricRecord(
            {"accuracy": float(np.mean([c["metrics"]["accuracy"] for c in contents]))}))
        self.exp, self.node_of, self.log = exp, node_of, log

    def _messages(self, kind: str, cids: list[int], arrays: ArrayRecord, config: ConfigRecord,
                  rnd: int) -> list[Message]:
        config["server-round"] = rnd
        content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return [Message(content, self.node_of[c], kind) for c in cids]

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.log["t0"] = time.perf_counter()
        cids = self.exp.sampling[server_round - 1]
        return self._messages(MessageType.TRAIN, cids, arrays, config, server_round)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        ok = [m for m in replies if not m.has_error()]
        self.log["errors"] += [m.error.reason for m in replies if m.has_error()]
        self.log["up_bytes"].append(sum(len(a.data) for m in ok for a in m.content.array_records["arrays"].values()))
        self._note_workers(ok)
        out = super().aggregate_train(server_round, replies)
        self.log["round_s"].append(time.perf_counter() - self.log["t0"])
        metrics = [m.content.metric_records["metrics"] for m in ok]
        losses = [scalar(r["train-loss"]) for r in metrics]
        self.log["train_loss"].append(float(np.mean(losses)) if losses else None)
        self.log["client_setup_s"] += [scalar(r["setup-s"]) for r in metrics]
        self.log["client_train_s"] += [scalar(r["train-s"]) for r in metrics]
        return out

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if not is_eval_round(self.exp.cfg, server_round):
            return []
        self.log["te"] = time.perf_counter()
        return self._messages(MessageType.EVALUATE, self.exp.train_ids, arrays, config, server_round)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        replies = list(replies)
        self.log["errors"] += [m.error.reason for m in replies if m.has_error()]
        self._note_workers([m for m in replies if not m.has_error()])
        out = super().aggregate_evaluate(server_round, replies)
        if out is not None:
            self.log["pm"][server_round] = scalar(out["accuracy"])
            self.log["eval_s"] += time.perf_counter() - self.log["te"]
        return out

    def _note_workers(self, ok: list[Message]) -> None:
        for m in ok:
            metrics = m.content.metric_records["metrics"]
            self.log["worker_rss_mb"] = max(self.log["worker_rss_mb"], scalar(metrics["rss-mb"]))
            if "threads" in metrics:
                self.log["worker_threads"] = int(scalar(metrics["threads"]))


def make_server_app(exp: Experiment, log: Log) -> ServerApp:
    app = ServerApp()
    cfg = exp.cfg
    fresh_private = {n: exp.init_params[n] for n in exp.private_names}

    def gm(rnd: int, arrays: ArrayRecord) -> MetricRecord | None:
        # Centralized evaluation: GLOBAL tensors + fresh PRIVATE ones on the global test set.
        # Flower calls it last in every round, so it also stamps the round's end.
        out = None
        if rnd == 0 or is_eval_round(cfg, rnd):
            t = time.perf_counter()
            exp.model.load_params({**arrays.to_torch_state_dict(), **fresh_private})
            logits = exp.model.predict(exp.data.test_texts, cfg.eval.batch_size).numpy()
            c = len(exp.data.class_names)
            log["gm"][rnd] = classification_metrics(exp.data.test_labels, logits, c)["accuracy"]
            log["eval_s"] += time.perf_counter() - t
            out = MetricRecord({"accuracy": log["gm"][rnd]})
        if rnd:
            log["round_wall_s"].append(time.perf_counter() - log["t0"])
        return out

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        # In simulation node ids are random; ask each node its partition id (= client id) once.
        while len(ids := list(grid.get_node_ids())) < len(exp.train_ids):
            time.sleep(0.1)
        replies = grid.send_and_receive([Message(RecordDict(), i, MessageType.QUERY) for i in ids])
        node_of = {int(scalar(m.content.config_records["node"]["partition-id"])): m.metadata.src_node_id
                   for m in replies}
        strategy = SampledFedAvg(exp, node_of, log)
        initial = ArrayRecord.from_torch_state_dict({n: exp.init_params[n] for n in exp.global_names})
        strategy.start(grid, initial, num_rounds=cfg.server.rounds, evaluate_fn=gm)

    return app


def run_tutorial_style(cfg_path: str, overrides: list[str], rounds: int) -> dict:
    """Run CONFIG (with --set overrides) for `rounds` rounds the Flower-tutorial way."""
    t_start = time.perf_counter()
    # Tutorial style: no frozen work is cached (runtime.cache, docs/design.md §7), nothing is reused.
    cfg = load_config(Path(cfg_path),
                      ["runtime.precision=fp32", *overrides, f"server.rounds={rounds}", "runtime.cache=false"])
    if cfg.server.optimizer != "fedavg" or cfg.server.aggregation != "mean" or cfg.client.upload != "fp32":
        raise ValueError("flower_tutorial: needs server.optimizer = fedavg, server.aggregation = mean and "
                         "client.upload = fp32 (what stock FedAvg does)")
    exp = build(cfg)  # the server's copy: partition, sampling stream, names, init, GM model
    # FedPuReL's state holds its zero-shot rows (none with runtime.cache = false: the objective computes
    # them every step) and phase 2's branch (none with phase 2 off): nothing the tutorial's client would keep
    m = method_params(cfg)
    phase2_off = (cfg.algorithm == "fedpurel" and getattr(m, "phase2", "") == "after"
                  and getattr(m, "personal_rounds", 1) == 0)
    if cfg.switch or (exp.recipe.state is not dict and not phase2_off):  # the tutorial's client keeps only tensors
        raise ValueError("flower_tutorial: needs a method without a state type of its own (FedProx, HetLoRA, "
                         "FLoRA have one; FedPuReL only with method.phase2 = 'after', method.personal_rounds = 0) "
                         "and no [switch.*]: the tutorial loop runs neither")
    t_built = time.perf_counter()
    log: Log = {"gm": {}, "pm": {}, "round_s": [], "round_wall_s": [], "up_bytes": [], "train_loss": [],
                "client_setup_s": [], "client_train_s": [], "eval_s": 0.0, "errors": [], "worker_rss_mb": 0.0,
                "worker_threads": None}
    run_simulation(
        server_app=make_server_app(exp, log), client_app=make_client_app(cfg),
        num_supernodes=len(exp.train_ids),  # node i holds client i; held-out clients never train
        backend_name="ray",
        # 1 CPU per client, so two ClientApps run at once on 2 cores (Flower's default is 2).
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    if log["errors"] or len(log["round_s"]) != rounds:  # a benchmark with failed clients means nothing
        raise RuntimeError(f"flower_tutorial: {len(log['round_s'])} of {rounds} rounds ran; "
                           f"client errors: {log['errors'][:3]}")
    last = max(log["pm"]) if log["pm"] else None
    return {
        "config": str(cfg_path), "algorithm": cfg.algorithm, "rounds": rounds,
        "seconds_total": round(time.perf_counter() - t_start, 2),
        "setup_s": round(t_built - t_start, 2),  # the server's experiment.build, as _run.py's setup_s
        # Train phase only (send, local training, FedAvg), as fedsplice's time_s / _run.py's mean_train_s;
        # with the round's evaluation (federated PM + centralized GM), as _run.py's round_s.
        "seconds_per_round": [round(s, 2) for s in log["round_s"]],
        "seconds_per_round_with_eval": [round(s, 2) for s in log["round_wall_s"]],
        "seconds_eval": round(log["eval_s"], 2),
        "client_setup_s_mean": round(float(np.mean(log["client_setup_s"])), 2),  # fresh model from the checkpoint
        "client_train_s_mean": round(float(np.mean(log["client_train_s"])), 2),  # local_train
        "gm_accuracy": log["gm"].get(last) if last is not None else None,
        "pm_accuracy": log["pm"].get(last) if last is not None else None,
        "gm_per_round": log["gm"], "pm_per_round": log["pm"], "train_loss": log["train_loss"],
        # ru_maxrss of this process (server + Ray driver) and of the ClientApp workers (each
        # reports its own in its replies); Ray's raylet/GCS processes are not counted.
        "peak_rss_mb": round(max(peak_rss_mb(), log["worker_rss_mb"]), 1),
        "peak_rss_mb_main": round(peak_rss_mb(), 1), "peak_rss_mb_worker": round(log["worker_rss_mb"], 1),
        "worker_torch_threads": log["worker_threads"],
        "up_bytes_per_round": float(np.mean(log["up_bytes"])),  # .npy bytes of the uploaded ArrayRecords
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    print(json.dumps(run_tutorial_style(a.config, a.set, a.rounds)), flush=True)


if __name__ == "__main__":
    main()
