"""The signatures of a method's hooks, as Protocols that mypy checks (fedsplice.algorithms.recipe).

Parameters are positional-only, so a method names its own arguments. Tensor dicts map trainable
tensor names to tensors; a *slot* is the method's per-client state (Recipe.state: its own
dataclass, or a tensor dict), kept on the client between its tasks and never sent. Where a hook's argument is the model
(`fedsplice.model.TaskModel`, which imports this package) it is typed as an `nn.Module`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn
from typing_extensions import TypeVar

from fedsplice.core.context import TrainContext

if TYPE_CHECKING:
    from fedsplice.config import ExperimentConfig

Tensors = Mapping[str, torch.Tensor]
# A method's client state (its *slot*): the dataclass its Recipe.state declares (HetLoRA's rank, an
# int), or a tensor dict. The hooks, Personal, Exchange and Recipe are generic in it: a build
# annotated `-> Recipe[MyState]` has every hook checked against MyState (a bare Recipe: any state).
S = TypeVar("S", default=Any)
S_in = TypeVar("S_in", contravariant=True, default=Any)  # a hook that only reads the state
Scores = dict[str, float | int | None]  # model.task = "generate": answer scores (federation.generative.scores)


class ModelFn(Protocol):
    """ClientOps.run's and .cached's `fn`: (the model, texts, eval batch size) -> a tensor, a row
    per text."""

    def __call__(self, model: nn.Module, texts: list[str], batch_size: int, /) -> torch.Tensor: ...


class Around(Protocol):
    """A change to the model around some of its forwards: a context manager over the model,
    undone on exit (FedDPA's adapter mix, feddpa.Mix). Phase.around, ClientOps.test_logits'
    groups."""

    def __call__(self, model: nn.Module, /) -> AbstractContextManager[None]: ...


class ClientOps(Protocol):
    """What a method's `Personal` hooks may do on the client they run for, where its data and
    state are (fedsplice.federation.tasks implements it; nothing of it leaves the client). Tensor
    dicts name trainable tensors; loading one sets those tensors in the client's model."""

    cid: int

    @property
    def num_classes(self) -> int:
        """How many classes the task has."""
        ...

    def fresh(self) -> dict[str, torch.Tensor]:
        """A copy of every trainable tensor at its initialization (the run's seeded init)."""
        ...

    def test_logits(self, params: Mapping[str, torch.Tensor],
                    groups: Sequence[tuple[Around, np.ndarray]] | None = None) -> np.ndarray | Scores:
        """`params` loaded: the model's logits [n_test, C] on the client's local test set (with
        model.task = "generate", which has no classes: the scores dict of its free-text answers,
        fedsplice.federation.generative.scores, which `Personal.predict` returns as it gets it).
        With `groups` ([(around, positions in the local test set)], every position in exactly
        one), each group's samples are scored together under their own change to the model
        (FedDPA: the samples of one α, under that α's adapter mix)."""
        ...

    def run(self, params: Mapping[str, torch.Tensor], on: str, fn: ModelFn) -> torch.Tensor:
        """`params` loaded, without gradients: what `fn(model, texts, batch_size)` makes of the
        client's local test set (`on` = "test") or of its training samples in their order (`on` =
        "train"), eval.batch_size the batch size (e.g. FedDPA's input features under its local
        adapter alone: feddpa.local_features)."""
        ...

    def rng(self, key: int) -> np.random.Generator:
        """A generator of this client's own, seeded by the run's seed, the client and `key`
        (the same draws in every run of the config and on every runtime)."""
        ...

    def labels(self) -> np.ndarray:
        """The class labels of the client's training samples, in their order."""
        ...

    def logits(self, params: Mapping[str, torch.Tensor], texts: list[str]) -> torch.Tensor:
        """`params` loaded: the model's logits [len(texts), C] on `texts` (eval mode)."""
        ...

    def sample_ids(self) -> np.ndarray:
        """The ids of the client's training samples, in their order (an objective's `ids`)."""
        ...

    def cached(self, key: str, fn: ModelFn) -> torch.Tensor | None:
        """Frozen work, computed once per process: `fn(model, texts, batch_size)` over the whole
        training set (without gradients; `fn` must not depend on any trainable tensor,
        e.g. FedPuReL's zero-shot logits under the model's zero-shot switch), kept under `key`;
        returns this client's rows, in the order of its training samples. None with runtime.cache
        = false: the method computes what it needs where it needs it."""
        ...

    def train_logits(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """`params` loaded: the model's logits on the client's training data, in a table
        [N, C] indexed by training sample id (as an objective looks them up by `ids`)."""
        ...

    def train(self, params: Mapping[str, torch.Tensor], objective: Objective, rounds: range, *,
              client: Mapping[str, Any], **ctx: Any) -> dict[str, torch.Tensor]:
        """`params` loaded and trained on `objective` ((model, texts, y, ids, ctx) -> {name:
        loss}) for one local budget per round key in `rounds` (each its own data order; one
        optimizer across them), with the client config changed by `client` (e.g. momentum=0.0);
        `ctx` sets the TrainContext's other fields (e.g. round, state); the task loss is
        plain cross-entropy (the config's switches train the rounds).
        Returns the trained tensors (CPU copies)."""
        ...


class LossTerm(Protocol):
    """A loss on the parameters alone, added to the task loss (PFAdapter's orthogonality)."""

    def __call__(self, params: Tensors, ctx: TrainContext, /) -> torch.Tensor: ...


class Objective(Protocol):
    """The losses of one forward on a batch: {loss name: scalar} (FedPuReL's task and KL)."""

    def __call__(self, model: nn.Module, texts: list[str], y: torch.Tensor, ids: np.ndarray, ctx: TrainContext,
                 /) -> dict[str, torch.Tensor]: ...


class GradTransform(Protocol):
    """{loss name: [gradient per parameter]} -> ([the step's gradient per parameter], stats)."""

    def __call__(self, grads: dict[str, list[torch.Tensor]],
                 /) -> tuple[list[torch.Tensor], Mapping[str, torch.Tensor | float]]: ...


class Fit(Protocol[S]):
    """Personal.fit: before the round's local training, on the GLOBAL tensors received."""

    def __call__(self, ops: ClientOps, rnd: int, received: Tensors, slot: S, /) -> S: ...


class Predict(Protocol[S_in]):
    """Personal.predict: the PM's test logits [n_test, C] (on generate: the scores dict)."""

    def __call__(self, ops: ClientOps, params: Tensors, slot: S_in, /) -> np.ndarray | Scores: ...


class After(Protocol[S_in]):
    """Personal.after: the local stage after the rounds; its test logits."""

    def __call__(self, ops: ClientOps, global_params: Tensors, slot: S_in, /) -> np.ndarray: ...


class Receive(Protocol[S]):
    """Exchange.receive: (the tensors the client trains from, its slot)."""

    def __call__(self, ops: ClientOps, rnd: int, received: Tensors, slot: S, /) -> tuple[Tensors, S]: ...


class Send(Protocol[S]):
    """Exchange.send: (the GLOBAL upload, the slot, scalar statistics; a statistic
    "weight/<GLOBAL tensor>", core.server.OWN_WEIGHT, is the client's own aggregation weight of
    that tensor instead of its sample count)."""

    def __call__(self, ops: ClientOps, rnd: int, trained: Tensors, slot: S,
                 /) -> tuple[Tensors, S, dict[str, float]]: ...


class MakePrompt(Protocol):
    """What PromptParts.modules gets to draw another CoOp learner like the model's own."""

    def __call__(self) -> nn.Module: ...


class PromptModules(Protocol):
    """PromptParts.modules: (make_prompt, the CoOp prompt, the model's generator) -> {name: module}."""

    def __call__(self, make_prompt: MakePrompt, prompt: nn.Module, gen: torch.Generator,
                 /) -> dict[str, nn.Module]: ...


class EncodePrompt(Protocol):
    """What PromptParts.class_embeddings gets: (a CoOp learner, a context of its shape in place of
    its own (None: its own)) -> normalized class embeddings [C, D]."""

    def __call__(self, learner: nn.Module, ctx: torch.Tensor | None = None, /) -> torch.Tensor: ...


class ClassEmbeddings(Protocol):
    """PromptParts.class_embeddings: (encode, modules) -> [C, D] or [K, C, D]."""

    def __call__(self, encode: EncodePrompt, modules: Mapping[str, nn.Module], /) -> torch.Tensor: ...


class InputViews(Protocol):
    """What a method's scorer may read of a batch of inputs (PromptParts.scorer), each computed on
    first use."""

    def pooled(self) -> torch.Tensor:
        """[B, D]: the input side's features, what the model's cosine scorer reads."""
        ...

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, M, D], mask [B, M]): the frozen input tower's token features, L2-normalized per
        token and padded (a text's last hidden states; a CLIP image's projected patch tokens)."""
        ...


class Scorer(Protocol):
    """PromptParts.scorer: (the batch's input views, the class side) -> scores [B, C] before the
    logit scale."""

    def __call__(self, inputs: InputViews, class_emb: torch.Tensor, /) -> torch.Tensor: ...


class BesideInit(Protocol):
    """Beside.init: (out_features, in_features) of an adapted Linear -> the tensor's start value."""

    def __call__(self, out_features: int, in_features: int, /) -> torch.Tensor: ...


class BesideAdd(Protocol):
    """Beside.add: (the Linear's input x, the tensor) -> the term added to the Linear's output."""

    def __call__(self, x: torch.Tensor, tensor: torch.Tensor, /) -> torch.Tensor: ...


class CheckConfig(Protocol):
    """Algorithm.check_config: raise a one-line ConfigError for a config the method cannot run."""

    def __call__(self, params: Any, cfg: ExperimentConfig, /) -> None: ...  # params: the [method] dataclass


class Label(Protocol):
    """Algorithm.label: the method's name in results."""

    def __call__(self, cfg: ExperimentConfig, /) -> str: ...
