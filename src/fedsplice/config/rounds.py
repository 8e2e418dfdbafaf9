"""The sections that say how the rounds run: client, server, eval, runtime, faults.

Each section is a dataclass whose `check()` validates its own fields. Whether the server
optimizer accepts its hyperparameters is checked where the optimizers live
(`fedsplice.federation.validate` builds it once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from fedsplice.config.checks import check_device_name, check_positive, refuse_inert
from fedsplice.errors import ConfigError


@dataclass
class ClientConfig:
    local_epochs: int = 1
    max_steps: int = 0  # cap on local steps per round; 0 = whole epochs
    batch_size: int = 16
    lr: float = 5e-4
    weight_decay: float = 0.0
    optimizer: Literal["adamw", "sgd"] = "adamw"
    momentum: float = 0.0  # SGD only (torch.optim.SGD's momentum; Dassl, FedPuReL's code base, uses 0.9)
    # the client lr over the rounds, constant within a round: constant, or cosine annealing from
    # client.lr toward client.lr_min, lr_t = lr_min + (lr − lr_min)·(1 + cos(π·s/T))/2 with s read
    # at the round's start (s = t−1: round 1 at client.lr, PFAdapter's §V-A) or its end (s = t:
    # the last round at lr_min, FlowerTune's `cosine_annealing(current_round, ...)`), t = 1..T
    schedule: Literal["constant", "cosine"] = "constant"
    lr_min: float = 0.0
    cosine_at: Literal["round_start", "round_end"] = "round_start"
    # The optimizer's state (SGD momentum, Adam moments) between a client's rounds. fresh: a new
    # optimizer every client-round for every tensor, GLOBAL, PRIVATE and the residual branch alike
    # (the official code of FedSA-LoRA, of FedPuReL's branch and of the gradient-balancing switch);
    # keep_private: PRIVATE tensors keep theirs across the client's rounds (GLOBAL ones still start
    # fresh: they arrive new each round)
    optimizer_state: Literal["fresh", "keep_private"] = "fresh"
    # per loss term (PFAdapter's orthogonality), ‖∇term‖ / ‖∇task‖ on the GLOBAL and PRIVATE tensors
    # on each client-round's last step, in metrics.jsonl: 1 + (terms) extra backward passes a
    # client-round; false skips them (training is the same either way)
    diagnostics: bool = True
    # Upload codec of the GLOBAL tensors: fp32 sends the tensors; fp16 / int8 send the round's
    # update (trained - received) compressed, int8 with error feedback kept on the client.
    upload: Literal["fp32", "fp16", "int8"] = "fp32"
    # clip the trainable tensors' gradient to this global L2 norm before each step (Hugging Face
    # Trainer's max_grad_norm, 1.0 there by default); 0 = no clipping
    max_grad_norm: float = 0.0

    def check(self) -> None:
        if self.optimizer_state not in ("fresh", "keep_private"):
            raise ConfigError(f"client.optimizer_state must be 'fresh' (a new optimizer every client-round) or "
                              f"'keep_private' (PRIVATE tensors keep theirs), got {self.optimizer_state!r}")
        check_positive("client.local_epochs", self.local_epochs)
        check_positive("client.batch_size", self.batch_size)
        check_positive("client.lr", self.lr)
        if self.max_steps < 0:
            raise ConfigError("client.max_steps must be >= 0 (0 = whole epochs)")
        if self.weight_decay < 0:
            raise ConfigError("client.weight_decay must be >= 0")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"client.momentum must be in [0, 1), got {self.momentum}")
        if self.momentum > 0 and self.optimizer != "sgd":
            raise ConfigError(f"client.momentum is SGD's; with client.optimizer = {self.optimizer!r} set it to 0 "
                              f"or set client.optimizer = 'sgd'")
        if self.schedule not in ("constant", "cosine"):
            raise ConfigError(f"client.schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        self.check_cosine()
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            raise ConfigError(f"client.max_grad_norm must be a finite number >= 0 (0 = no clipping), "
                              f"got {self.max_grad_norm}")

    def check_cosine(self) -> None:
        if self.schedule != "cosine":
            refuse_inert("client", self, ("lr_min", "cosine_at"), f"client.schedule = {self.schedule!r}",
                         "set client.schedule = 'cosine'")
        if self.cosine_at not in ("round_start", "round_end"):
            raise ConfigError(f"client.cosine_at must be 'round_start' (round 1 at client.lr) or 'round_end' "
                              f"(the last round at client.lr_min), got {self.cosine_at!r}")
        if not (math.isfinite(self.lr_min) and 0 <= self.lr_min < self.lr):
            raise ConfigError(f"client.lr_min must be >= 0 and below client.lr ({self.lr}), got {self.lr_min}")

    def lr_at(self, rnd: int, rounds: int) -> float:
        """The client lr of round `rnd` (1-based) of `rounds` under client.schedule."""
        if self.schedule == "constant" or rounds <= 0:
            return self.lr
        s = min(max(rnd, 1), rounds) - (1 if self.cosine_at == "round_start" else 0)
        return self.lr_min + (self.lr - self.lr_min) * 0.5 * (1.0 + math.cos(math.pi * s / rounds))


@dataclass
class ServerConfig:
    rounds: int = 10
    clients_per_round: int = 4
    optimizer: Literal["fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"] = "fedavg"
    lr: float = 0.0  # server learning rate η; 0 = the optimizer's default (1.0 FedAvg/M, 1e-2 adaptive)
    momentum: float = 0.9  # FedAvgM
    # momentum on the pseudo-gradient (Reddi et al. Alg. 2); negative = the optimizer's default:
    # 0.9 for FedAdam/FedYogi, 0.0 for FedAdagrad (the paper's analysed and run FedAdagrad)
    beta1: float = -1.0
    beta2: float = 0.99
    tau: float = 1e-3  # adaptivity ε of FedAdam/FedYogi/FedAdagrad
    bias_correction: bool = False  # Reddi et al. Alg. 2 has none; Adam-style implementations do
    initial_accumulator: float = -1.0  # v_{-1}; negative = tau**2 (the paper)
    # Failing clients (any runtime): a round aggregates once it holds `min_replies` valid
    # replies; with fewer, the clients without one are asked again up to `max_retries` times,
    # then the round is skipped (global tensors unchanged) and logged.
    min_replies: int = 1
    max_retries: int = 1
    round_deadline_s: float = 0.0  # replies later than this are discarded as late; 0 = no deadline
    # Untrusted clients: an update whose delta has an L2 norm above the bound is rejected (0 = no
    # bound); "median" / "trimmed_mean" aggregate coordinate-wise and ignore sample counts.
    update_norm_bound: float = 0.0
    aggregation: Literal["mean", "median", "trimmed_mean"] = "mean"
    trim_fraction: float = 0.1  # trimmed_mean: share cut from each end, per coordinate

    def check(self) -> None:
        check_positive("server.rounds", self.rounds)
        check_positive("server.clients_per_round", self.clients_per_round)
        if self.lr < 0:
            raise ConfigError(f"server.lr must be >= 0 (0 = the optimizer's default), got {self.lr}")
        if not 1 <= self.min_replies <= self.clients_per_round:
            raise ConfigError(f"server.min_replies must be in [1, server.clients_per_round] = "
                              f"[1, {self.clients_per_round}], got {self.min_replies}")
        if not 0 <= self.max_retries <= 100:
            raise ConfigError(f"server.max_retries must be in [0, 100], got {self.max_retries}")
        if self.round_deadline_s < 0:
            raise ConfigError(f"server.round_deadline_s must be >= 0 (0 = no deadline), got {self.round_deadline_s}")
        if self.update_norm_bound < 0:
            raise ConfigError(f"server.update_norm_bound must be >= 0 (0 = no bound), got {self.update_norm_bound}")
        if not 0 <= self.trim_fraction < 0.5:
            raise ConfigError(f"server.trim_fraction must be in [0, 0.5), got {self.trim_fraction}")

    def optimizer_kwargs(self) -> dict:
        """Only the hyperparameters the chosen server optimizer takes."""
        kw: dict = {"lr": self.lr} if self.lr > 0 else {}
        if self.optimizer == "fedavgm":
            kw["momentum"] = self.momentum
        if self.optimizer in ("fedadam", "fedyogi"):
            kw.update(beta1=self.beta1 if self.beta1 >= 0 else 0.9, beta2=self.beta2,
                      bias_correction=self.bias_correction)
        if self.optimizer == "fedadagrad" and self.beta1 >= 0:
            kw["beta1"] = self.beta1
        if self.optimizer in ("fedadam", "fedyogi", "fedadagrad"):
            kw["tau"] = self.tau
            if self.initial_accumulator >= 0:
                kw["initial_accumulator"] = self.initial_accumulator
        return kw


@dataclass
class EvalConfig:
    every: int = 1  # evaluate GM/PM every N rounds (the last round always)
    batch_size: int = 64
    cold_start_epochs: int = 5  # held-out clients: step 0, then after 1..N local epochs
    many_threshold: int = 100  # many-shot classes: > this many global training samples
    few_threshold: int = 20  # few-shot classes: < this many; medium in between
    # a shot group (many / medium / few) is reported only on at least this many test samples
    # (PM pools the clients' local test sets); fewer: null, and "<group>_n" says how many
    min_group_samples: int = 30
    balancedness_sigma: float = 0.1  # σ of β(V); 0.1 and 0.01 are always reported too
    # "validation": evaluate on validation_per_class training samples of each class, held out of
    # training, instead of the test set (choosing hyperparameters without looking at the test set)
    on: Literal["test", "validation"] = "test"
    validation_per_class: int = 10
    max_new_tokens: int = 64  # generate: the longest answer generated (greedy, stopped at EOS)
    stop: list[str] = field(default_factory=list)  # generate: an answer also ends before the first of these

    def check(self) -> None:
        check_positive("eval.every", self.every)
        check_positive("eval.batch_size", self.batch_size)
        if self.cold_start_epochs < 0:
            raise ConfigError("eval.cold_start_epochs must be >= 0")
        if not 0 <= self.few_threshold <= self.many_threshold:
            raise ConfigError(f"eval.few_threshold ({self.few_threshold}) must be in [0, "
                              f"eval.many_threshold ({self.many_threshold})]")
        check_positive("eval.balancedness_sigma", self.balancedness_sigma)
        check_positive("eval.min_group_samples", self.min_group_samples)
        check_positive("eval.validation_per_class", self.validation_per_class)
        check_positive("eval.max_new_tokens", self.max_new_tokens)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"eval.stop = {self.stop!r}: each stop string must be non-empty text (an empty one "
                              f"would end every answer at once)")
        if self.on not in ("test", "validation"):
            raise ConfigError(f"eval.on must be 'test' or 'validation', got {self.on!r}")


@dataclass
class RuntimeConfig:
    kind: Literal["simulation", "flower"] = "simulation"  # flower: Flower deployment engine (docs/flower.md)
    # flower only: SuperNodes `fedsplice flower up` starts (node p serves clients cid % N == p), and
    # TLS + SuperNode authentication off (loopback experiments only; warned). Flower uses
    # server.min_replies / max_retries / round_deadline_s like the simulation does.
    num_supernodes: int = 2
    insecure: bool = False
    store: Literal["memory", "disk"] = "memory"  # where PRIVATE client state lives between rounds
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    # where the model, its PEFT tensors, caches and training live: "auto" = CUDA when present,
    # else MPS, else CPU. The store, the wire and the server math stay on the CPU (float64 server)
    device: str = "auto"
    # autocast for forward + backward; trainable tensors stay fp32 masters; fp16 adds a gradient
    # scaler. "auto": bf16 where this machine runs it faster than fp32 (fedsplice.model.device:
    # a GPU with native bf16, plus TF32; a CPU with native bf16 for a model at least 192 wide,
    # 768 for LoRA on a CPU with AMX),
    # else fp32. Numbers then differ by rounding between machines: "fp32" compares across them
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # unpadded batches (fedsplice.model.unpad): a batch runs as sub-batches of similar length, the
    # same math within rounding. "auto": on the CPU (measured faster), except while LoRA dropout
    # trains (its masks are drawn per padded position); "on"; "off": padded to the longest member
    unpad: Literal["auto", "on", "off"] = "auto"
    # every client's PM scored in one pass over the union of their local test sets, each row
    # through its own client's LoRA factors (fedsplice.federation.batched; the same metrics within
    # rounding, 1.2-1.45x faster: docs/performance.md). "auto" (the default): where the run allows
    # it (LoRA on a text encoder's input side, its class side frozen; one process; no PM rule of
    # the method's own); "on": required (validate says what is in the way); "off": one client at a
    # time, whose numbers equal Flower's and runtime.workers' bit for bit (batched ones differ in
    # the low bits)
    batch_eval: Literal["auto", "on", "off"] = "auto"
    # a round's clients trained together: one forward and backward over the frozen base a step,
    # each client's rows through its own LoRA factors (or CoOp context), its own loss and
    # optimizer (fedsplice.federation.batched_train; the same math within rounding). "auto" (the
    # default): where the run allows it and it measured faster (a CoOp context alone; LoRA under
    # bf16 autocast, not fp32: docs/performance.md); "on": required, wherever it applies;
    # "off": one client after another
    batch_train: Literal["auto", "on", "off"] = "auto"
    # simulation only: persistent worker processes, each building its own model and caches once
    # and using runtime.threads torch threads (0: cores // workers). A round's clients run on them
    # at once; client c always on worker c % workers, where its PRIVATE state lives. Metrics equal
    # workers = 1 at the same runtime.threads (docs/performance.md). Flower: set num_supernodes
    workers: int = 1
    devices: list[str] = field(default_factory=list)  # per worker (cycled); empty: runtime.device
    checkpoint_every: int = 1  # rounds between checkpoints (the last round always); 0 = none
    # rounds between the global model's LoRA written as a PEFT folder RUN/peft_<round>/ (and after
    # the last round), as FlowerTune's server saves it (train.save-every-round); every one is kept;
    # 0 = none (`fedsplice export` writes one from the last checkpoint)
    save_adapter_every: int = 0
    keep_checkpoints: int = 2  # the newest k checkpoints are kept
    # Frozen work computed once (docs/design.md §7): tokenized inputs, frozen input features, hidden
    # states below the first adapted layer. false = recompute everything every step (checks,
    # benchmarks). The prefix cache holds at most cache_budget_mb; past that it computes afresh.
    cache: bool = True
    cache_budget_mb: int = 1024
    cache_dir: str = ""  # "" = in memory; a folder = memory-mapped .npy files there

    def check(self) -> None:
        if self.threads < 0:
            raise ConfigError("runtime.threads must be >= 0 (0 = torch default)")
        check_positive("runtime.workers", self.workers)
        if self.workers > 1 and self.kind != "simulation":
            raise ConfigError(f"runtime.workers = {self.workers} runs clients in parallel processes in the simulation "
                              f"only; on Flower every SuperNode is a process of its own: set runtime.workers = 1 "
                              f"and runtime.num_supernodes")
        for i, d in enumerate([self.device, *self.devices]):
            check_device_name("runtime.device" if i == 0 else f"runtime.devices[{i - 1}]", d)
        check_positive("runtime.num_supernodes", self.num_supernodes)
        if self.checkpoint_every < 0:
            raise ConfigError(f"runtime.checkpoint_every must be >= 0 (0 = no checkpoints), "
                              f"got {self.checkpoint_every}")
        check_positive("runtime.keep_checkpoints", self.keep_checkpoints)
        if self.save_adapter_every < 0:
            raise ConfigError(f"runtime.save_adapter_every must be >= 0 (0 = none), got {self.save_adapter_every}")
        if self.cache_budget_mb < 0:
            raise ConfigError(f"runtime.cache_budget_mb must be >= 0 (0 = no prefix cache), got {self.cache_budget_mb}")


@dataclass
class FaultsConfig:
    """Injected client failures (simulation runtime), drawn per (seed, round, attempt, client)."""

    dropout: float = 0.0  # probability that a sampled client never replies
    straggler: float = 0.0  # probability that a sampled client is slow ...
    straggler_delay_s: float = 60.0  # ... and replies after this long (late if > server.round_deadline_s)

    def check(self) -> None:
        for name in ("dropout", "straggler"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"faults.{name} must be a probability in [0, 1], got {v}")
        if self.straggler_delay_s < 0:
            raise ConfigError(f"faults.straggler_delay_s must be >= 0, got {self.straggler_delay_s}")

