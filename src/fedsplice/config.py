"""Typed experiment configs from one source: nested dataclasses, read from TOML, validated per field.

Every section is a dataclass; `load_config` walks the TOML table against the dataclass fields,
so an unknown key, a wrong type or an out-of-range value fails with a one-line ConfigError that
names the dotted field (`server.rounds`) and the fix. `--set a.b=value` overrides are applied to
the raw table before validation, so they go through exactly the same checks.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fedsplice.errors import ConfigError

ROLES = ("q", "k", "v", "o")


@dataclass
class ModelConfig:
    name: str = "zoo:minilm"  # zoo:minilm, zoo:smollm2, a hub id or a local path
    # dual_encoder: MiniLM (text) or CLIP (images; text prompts per class); vlm: a LLaVA-style
    # vision tower (model.vision) + projector + causal LM (model.name), verbalizer scoring
    task: Literal["dual_encoder", "encoder_head", "causal_lm", "vlm"] = "dual_encoder"
    class_prompt: str = "a quote about {label}."  # dual encoder: the text side of each class
    # prompt ensemble: more templates; the class embedding is the mean of the normalized
    # embeddings of class_prompt and these (CLIP's "a photo of a {label}." family)
    class_prompts: list[str] = field(default_factory=list)
    vision: str = ""  # vlm: the vision tower, zoo:tiny-vit, a hub id or a local path
    projector: Literal["linear", "mlp"] = "mlp"  # vlm: vision -> LM embeddings (trainable, GLOBAL)
    input_template: str = "{text}"  # causal LM: e.g. "Text: {text}\nTopic:"
    # Dual encoder with one shared encoder (MiniLM): do the adapters also encode the class
    # prompts? False = the class side stays frozen (as CLIP-LoRA on the input tower), so class
    # embeddings are computed once and cached; True recomputes them every step.
    class_side_adapters: bool = False
    logit_scale: float = 20.0  # s in s·cos(E(x), T(c)); ~20 fits MiniLM far better than CLIP's 100
    max_length: int = 128  # tokens per input; batches are padded to their longest member only

    def check(self) -> None:
        _positive("model.logit_scale", self.logit_scale)
        _positive("model.max_length", self.max_length)
        if self.name.startswith("zoo:"):
            from fedsplice.data.zoo import ZOO

            if self.name[4:] not in ZOO:
                raise ConfigError(f"model.name: unknown zoo model {self.name!r}; choose one of "
                                  f"{', '.join('zoo:' + k for k in ZOO)}, a local folder or a hub id")
        if "{label}" not in self.class_prompt:
            raise ConfigError("model.class_prompt must contain '{label}', e.g. 'a quote about {label}.'")
        for i, t in enumerate(self.class_prompts):
            if "{label}" not in t:
                raise ConfigError(f"model.class_prompts[{i}] must contain '{{label}}', e.g. 'a photo of a {{label}}.'")
        for name, t, key in [("model.class_prompt", self.class_prompt, "label"),
                             ("model.input_template", self.input_template, "text"),
                             *((f"model.class_prompts[{i}]", t, "label") for i, t in enumerate(self.class_prompts))]:
            try:
                t.format(**{key: "x"})
            except (KeyError, IndexError, ValueError) as e:
                raise ConfigError(f"{name}: only {{{key}}} may be filled in ({type(e).__name__}: {e}); "
                                  f"write a literal brace as {{{{ or }}}}") from None
        if self.task == "vlm" and not self.vision:
            raise ConfigError("model.vision: model.task = 'vlm' needs a vision tower, e.g. "
                              "'zoo:tiny-vit', 'openai/clip-vit-base-patch32' or a local folder")
        if self.vision and self.task != "vlm":
            raise ConfigError("model.vision is only used with model.task = 'vlm'; remove it or set the task")
        if "{text}" not in self.input_template:
            raise ConfigError("model.input_template must contain '{text}', e.g. 'Text: {text}\\nTopic:'")


@dataclass
class PeftConfig:
    type: Literal["lora", "prompt", "adapter"] = "lora"
    # LoRA (HF peft) on attention projections by role
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    roles: list[str] = field(default_factory=lambda: list(ROLES))
    layers: list[int] = field(default_factory=list)  # empty: every layer
    tower: str = ""  # CLIP-style models: "text_model" or "vision_model"; empty: the only tower
    use_rslora: bool = False  # scaling alpha/sqrt(r) instead of alpha/r
    # CoOp prompt context on the class side of a dual encoder
    n_ctx: int = 0  # 0: the words of model.class_prompt before {label}, initialized from them
    class_specific: bool = False  # one context per class instead of one shared
    portfolio: float = 0.0  # PromptFolio θ: mix a private local prompt's class features with weight θ
    # FedCLIP feature adapter on the input embedding
    adapter_hidden: int = 0  # 0: the embedding width

    def check(self) -> None:
        _positive("peft.r", self.r)
        _positive("peft.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"peft.dropout must be in [0, 1), got {self.dropout}")
        _roles("peft.roles", self.roles)
        if not self.roles:
            raise ConfigError("peft.roles is empty; list at least one of q, k, v, o")
        if any(i < 0 for i in self.layers):
            raise ConfigError(f"peft.layers must be non-negative layer indices, got {self.layers}")
        if self.n_ctx < 0 or self.adapter_hidden < 0:
            raise ConfigError("peft.n_ctx and peft.adapter_hidden must be >= 0 (0 = automatic)")
        if not 0.0 <= self.portfolio < 1.0:
            raise ConfigError(f"peft.portfolio must be in [0, 1), got {self.portfolio}")
        if self.portfolio > 0 and self.type != "prompt":
            raise ConfigError("peft.portfolio mixes prompt contexts: set peft.type = 'prompt'")


@dataclass
class DataConfig:
    dataset: str = "fortunes"  # see `fedsplice list datasets`; or csv:PATH / jsonl:PATH
    num_clients: int = 10
    partition: Literal["dirichlet", "iid", "shards"] = "dirichlet"
    alpha: float = 0.5  # Dirichlet concentration (smaller = more label skew)
    shards_per_client: int = 2
    test_per_class: int = 20  # balanced global test set
    max_per_class: int = 0  # cap on training samples per class; 0 = no cap
    local_test_size: int = 40  # per client, drawn to match its training label distribution
    holdout_clients: int = 0  # clients kept out of training for cold-start evaluation
    # Long tail (FedPuReL): n_c = n_max·IF^(−c/(C−1)) training samples for the c-th largest
    # class before partitioning; imbalance = 1 keeps the data as it is.
    imbalance: float = 1.0
    n_max: int = 0  # 0: the largest class's size
    # Users' image data (images:DIR, csv/jsonl with an `image` column): a file that fails to
    # decode is an error naming it; true reports each one and skips it instead.
    skip_bad_images: bool = False
    # Readable names for the labels of a user's data set, in label order (sorted labels): for
    # prompts such as "a photo of a {label}."; must list exactly one name per label.
    class_names: list[str] = field(default_factory=list)

    def check(self) -> None:
        from fedsplice.data.datasets import DATASETS

        kind, _, path = self.dataset.partition(":")
        if kind in ("csv", "jsonl") and path:
            if not Path(path).expanduser().is_file():
                raise ConfigError(f"data.dataset: file {path!r} not found; give an existing {kind} file")
        elif kind == "images" and path:
            if not Path(path).expanduser().is_dir():
                raise ConfigError(f"data.dataset: folder {path!r} not found; give a folder with one "
                                  f"subfolder of images per class (images:DIR)")
        elif self.dataset not in DATASETS:
            raise ConfigError(f"data.dataset: unknown {self.dataset!r}; choose one of "
                              f"{', '.join(DATASETS)}, or csv:PATH / jsonl:PATH / images:DIR")
        _positive("data.num_clients", self.num_clients)
        _positive("data.alpha", self.alpha)
        _positive("data.shards_per_client", self.shards_per_client)
        _positive("data.test_per_class", self.test_per_class)
        _positive("data.local_test_size", self.local_test_size)
        if self.max_per_class < 0:
            raise ConfigError("data.max_per_class must be >= 0 (0 = no cap)")
        if self.imbalance < 1:
            raise ConfigError(f"data.imbalance (IF) must be >= 1 (1 = no long-tail cut), got {self.imbalance}")
        if self.n_max < 0:
            raise ConfigError("data.n_max must be >= 0 (0 = the largest class's size)")
        if not 0 <= self.holdout_clients < self.num_clients:
            raise ConfigError(f"data.holdout_clients must be in [0, data.num_clients) = "
                              f"[0, {self.num_clients}), got {self.holdout_clients}")


@dataclass
class ScenarioConfig:
    """Multimodal heterogeneity (PFAdapter §V), applied to the clients' data (train and local
    test) after partitioning, from its own seeded stream; the global test set stays aligned.

    missing modality   a share `missing_rate` (β) of the clients (`missing_level = "client"`)
                       or of every client's samples ("sample") lose the `missing` modality
                       ("either": image or text, drawn per client / per sample)
    hybrid             `aligned_share` p of the clients stay aligned; the others lose the
                       modality on a share β of their samples (needs missing_level = "sample")
    modality-dominant  `image_dominant` clients lose the text and `text_dominant` clients the
                       image on a share `dominant_rate` of their samples (I-5:T-5 = 5 and 5)
    Gaussian noise     images of a share `noise_clients` of the clients get N(0, σ²) noise,
                       σ = noise_std × 255, clipped to [0, 255]
    """

    missing_rate: float = 0.0
    missing_level: Literal["client", "sample"] = "client"
    missing: Literal["image", "text", "either"] = "either"
    aligned_share: float = 0.0
    image_dominant: int = 0
    text_dominant: int = 0
    dominant_rate: float = 0.8
    noise_std: float = 0.0
    noise_clients: float = 1.0

    def check(self) -> None:
        for name in ("missing_rate", "aligned_share", "dominant_rate", "noise_clients"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"scenario.{name} must be a share in [0, 1], got {v}")
        if self.noise_std < 0:
            raise ConfigError(f"scenario.noise_std must be >= 0 (a fraction of the pixel range), got {self.noise_std}")
        if self.image_dominant < 0 or self.text_dominant < 0:
            raise ConfigError("scenario.image_dominant and scenario.text_dominant must be >= 0 client counts")
        if self.aligned_share > 0 and self.missing_rate == 0:
            raise ConfigError("scenario.aligned_share (hybrid) needs scenario.missing_rate > 0: the share "
                              "of samples the non-aligned clients lose")
        if self.aligned_share > 0 and self.missing_level != "sample":
            raise ConfigError("scenario.aligned_share (hybrid) needs scenario.missing_level = 'sample': "
                              "the non-aligned clients lose the modality on a share missing_rate of their samples")
        if self.missing_rate > 0 and (self.image_dominant or self.text_dominant):
            raise ConfigError("scenario: choose missing modality (missing_rate) or modality-dominant clients "
                              "(image_dominant / text_dominant), not both")

    def active(self) -> bool:
        return bool(self.missing_rate or self.image_dominant or self.text_dominant or self.noise_std)


@dataclass
class ClientConfig:
    local_epochs: int = 1
    max_steps: int = 0  # cap on local steps per round; 0 = whole epochs
    batch_size: int = 16
    lr: float = 5e-4
    weight_decay: float = 0.0
    optimizer: Literal["adamw", "sgd"] = "adamw"
    logit_adjustment: float = 0.0  # τ of logit-adjusted training (Menon et al. 2021); 0 = off
    # Upload codec of the GLOBAL tensors: fp32 sends the tensors; fp16 / int8 send the round's
    # update (trained - received) compressed, int8 with error feedback kept on the client.
    upload: Literal["fp32", "fp16", "int8"] = "fp32"

    def check(self) -> None:
        if self.logit_adjustment < 0:
            raise ConfigError(f"client.logit_adjustment must be >= 0 (0 = off), got {self.logit_adjustment}")
        _positive("client.local_epochs", self.local_epochs)
        _positive("client.batch_size", self.batch_size)
        _positive("client.lr", self.lr)
        if self.max_steps < 0:
            raise ConfigError("client.max_steps must be >= 0 (0 = whole epochs)")
        if self.weight_decay < 0:
            raise ConfigError("client.weight_decay must be >= 0")


@dataclass
class ServerConfig:
    rounds: int = 10
    clients_per_round: int = 4
    optimizer: Literal["fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"] = "fedavg"
    lr: float = 0.0  # server learning rate η; 0 = the optimizer's default (1.0 FedAvg/M, 1e-2 adaptive)
    momentum: float = 0.9  # FedAvgM
    beta1: float = 0.9
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
        _positive("server.rounds", self.rounds)
        _positive("server.clients_per_round", self.clients_per_round)
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
            kw.update(beta1=self.beta1, beta2=self.beta2, bias_correction=self.bias_correction)
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
    balancedness_sigma: float = 0.1  # σ of β(V); 0.1 and 0.01 are always reported too

    def check(self) -> None:
        _positive("eval.every", self.every)
        _positive("eval.batch_size", self.batch_size)
        if self.cold_start_epochs < 0:
            raise ConfigError("eval.cold_start_epochs must be >= 0")
        if not 0 <= self.few_threshold <= self.many_threshold:
            raise ConfigError(f"eval.few_threshold ({self.few_threshold}) must be in [0, "
                              f"eval.many_threshold ({self.many_threshold})]")
        _positive("eval.balancedness_sigma", self.balancedness_sigma)


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
    checkpoint_every: int = 1  # rounds between checkpoints (the last round always); 0 = none
    keep_checkpoints: int = 2  # the newest k checkpoints are kept
    # Frozen work computed once (DESIGN §7): tokenized inputs, frozen input features, hidden
    # states below the first adapted layer. false = recompute everything every step (checks,
    # benchmarks). The prefix cache holds at most cache_budget_mb; past that it computes afresh.
    cache: bool = True
    cache_budget_mb: int = 1024
    cache_dir: str = ""  # "" = in memory; a folder = memory-mapped .npy files there

    def check(self) -> None:
        if self.threads < 0:
            raise ConfigError("runtime.threads must be >= 0 (0 = torch default)")
        _positive("runtime.num_supernodes", self.num_supernodes)
        if self.checkpoint_every < 0:
            raise ConfigError(f"runtime.checkpoint_every must be >= 0 (0 = no checkpoints), got {self.checkpoint_every}")
        _positive("runtime.keep_checkpoints", self.keep_checkpoints)
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


@dataclass
class ExperimentConfig:
    algorithm: str = "pfadapter"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    method: dict = field(default_factory=dict)  # the algorithm's own hyperparameters, validated by it
    data: DataConfig = field(default_factory=DataConfig)
    scenario: ScenarioConfig = field(default_factory=ScenarioConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    def check(self) -> None:
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if dataclasses.is_dataclass(sub):
                sub.check()
        trainable = self.data.num_clients - self.data.holdout_clients
        if self.model.class_prompts and self.peft.type == "prompt":
            raise ConfigError("model.class_prompts (an ensemble of fixed templates) cannot be used with "
                              "peft.type = 'prompt', which learns one context from model.class_prompt; "
                              "remove class_prompts")
        if self.scenario.image_dominant + self.scenario.text_dominant > self.data.num_clients:
            raise ConfigError(f"scenario.image_dominant + scenario.text_dominant "
                              f"({self.scenario.image_dominant} + {self.scenario.text_dominant}) exceeds "
                              f"data.num_clients ({self.data.num_clients})")
        if self.server.clients_per_round > trainable:
            raise ConfigError(
                f"server.clients_per_round ({self.server.clients_per_round}) exceeds the "
                f"{trainable} training clients (data.num_clients - data.holdout_clients)")
        if self.faults.straggler > 0 and not 0 < self.server.round_deadline_s < self.faults.straggler_delay_s:
            raise ConfigError(
                f"faults.straggler = {self.faults.straggler} needs 0 < server.round_deadline_s < "
                f"faults.straggler_delay_s ({self.faults.straggler_delay_s}); without a deadline a "
                f"slow client is simply waited for")
        if self.client.upload != "fp32" and self.runtime.kind == "flower":
            raise ConfigError(f"client.upload = {self.client.upload!r} is implemented by the simulation "
                              f"runtime only; use client.upload = 'fp32' with runtime.kind = 'flower'")
        from fedsplice.algorithms.registry import method_params  # validates `method` against the algorithm
        from fedsplice.core.server import make_server_optimizer  # validates the server hyperparameters

        method_params(self)
        make_server_optimizer(self.server.optimizer, **self.server.optimizer_kwargs())


def _positive(name: str, value) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


def _roles(name: str, roles) -> None:
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise ConfigError(f"{name}: unknown role(s) {bad}; roles are q, k, v, o")


# --------------------------------------------------------------------------- parsing


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}: unknown value {value!r}; choose one of {', '.join(map(str, choices))}")
        return value
    if origin in (list, tuple):
        (inner,) = typing.get_args(tp)[:1]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"{where}: union types are not supported in configs")
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    raise ConfigError(f"{where}: unsupported type {tp}")


def from_dict(cls, table: dict, where: str = ""):
    """Build dataclass `cls` from a TOML table; unknown keys and wrong types are errors."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where or 'config'}: expected a table, got {table!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - names)
    if unknown:
        name = unknown[0] if unknown[0].isprintable() else ascii(unknown[0])  # one line, always
        key = f"{where}.{name}" if where else name
        known = f"known fields here: {', '.join(sorted(names))}" if names else "this table takes no fields"
        raise ConfigError(f"{key}: unknown config field; {known}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in table.items()}
    return cls(**kwargs)


def _parse_value(text: str) -> Any:
    """A --set value is TOML (numbers, booleans, lists, quoted strings); bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(table: dict, overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set server.rounds=2")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = table
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {p} is not a table")
        node[parts[-1]] = _parse_value(text.strip())
    return table


def read_toml(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found; pass a path to a .toml file "
                          f"(see configs/) or no CONFIG for the embedded default")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None


DEFAULT_CONFIG = Path(__file__).parent / "defaults" / "default.toml"


def load_config(path: Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    table = read_toml(path or DEFAULT_CONFIG)
    apply_overrides(table, overrides or [])
    cfg = from_dict(ExperimentConfig, table)
    cfg.check()
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
