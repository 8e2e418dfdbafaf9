"""DP-FedAvg in the round loop: what [privacy] does to the GLOBAL updates, and the ε it spends.

central:     the server clips each accepted update to S, sums, adds N(0, (z·S)²) once, divides by m.
distributed: each client clips its own update and adds N(0, (z·S)²/m) before it uploads; the server
             only sums and divides by m (with secure aggregation it sees nothing else).
m is server.clients_per_round, fixed in advance: every accepted update weighs 1/m whatever its
sample count (DP needs weights that do not depend on the data), and a round with dropouts
releases a smaller sum rather than a mean over fewer clients. q = m / training clients.
PRIVATE tensors never leave a client: they take no clipping and no noise.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from fedsplice.core import privacy as dp
from fedsplice.core.streams import PRIVACY
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from opacus.accountants import PRVAccountant, RDPAccountant

    from fedsplice.algorithms import Recipe
    from fedsplice.config import ExperimentConfig
    from fedsplice.core.server import Params


@dataclass(frozen=True)
class Plan:
    mode: str
    clip: float
    noise_multiplier: float  # z, given or chosen for target_epsilon
    clients_per_round: int  # m
    sample_rate: float  # q
    delta: float
    accountant: str
    seeded: bool

    def epsilon(self, rounds: int) -> float:
        return _epsilon(self.noise_multiplier, self.sample_rate, rounds, self.delta, self.accountant)

    def server_view_epsilon(self, rounds: int) -> float | None:
        """ε against a server that reads each upload on its own (no secure aggregation): central
        mode gives it clipped updates in the clear (None: no guarantee); distributed mode gives
        it each client's update with noise z/√m, and the server knows who it sampled (q = 1)."""
        if self.mode != "distributed":
            return None
        return _epsilon(self.noise_multiplier / self.clients_per_round ** 0.5, 1.0, rounds, self.delta,
                        self.accountant)

    def summary(self, rounds: int) -> dict[str, str | float | None]:
        """results.json's "privacy": the setting and the ε spent after `rounds`."""
        return {"mode": self.mode, "clip": self.clip, "noise_multiplier": self.noise_multiplier,
                "clients_per_round": self.clients_per_round, "sample_rate": self.sample_rate,
                "delta": self.delta, "accountant": self.accountant, "rounds": rounds,
                "epsilon": self.epsilon(rounds), "server_view_epsilon": self.server_view_epsilon(rounds),
                "noise": "seeded" if self.seeded else "secure"}


@lru_cache(maxsize=256)  # a resumed or long run asks for the same rounds again
def _epsilon(z: float, q: float, rounds: int, delta: float, kind: str) -> float:
    return epsilon(z, q, rounds, delta, kind)


def plan(cfg: ExperimentConfig, n_train: int) -> Plan | None:
    """The run's DP setting, with the noise multiplier resolved; None when [privacy] is off."""
    p = cfg.privacy
    if not p.enabled:
        return None
    m, rounds = cfg.server.clients_per_round, cfg.server.rounds
    q = m / n_train
    z = p.noise_multiplier or noise_for(p.target_epsilon, p.delta, q, rounds, p.accountant)
    return Plan(p.mode, p.clip, z, m, q, p.delta, p.accountant, p.noise == "seeded")


def check_recipe(cfg: ExperimentConfig, recipe: Recipe, global_names: list[str]) -> None:
    """What DP-FedAvg cannot bound, nor SecAgg+ sum: a pooled reference, nothing sent (a method's
    own per-tensor weights: its check_config, config.privacy.refuse_own_weights, and the round
    loop's federation.rounds.weights_of)."""
    if not (cfg.privacy.enabled or cfg.privacy.secure_aggregation):
        return
    where = f"privacy.mode = {cfg.privacy.mode!r}" if cfg.privacy.enabled else "privacy.secure_aggregation = true"
    if recipe.pooled or not global_names:
        raise ConfigError(f"{where}: algorithm {cfg.algorithm!r} sends nothing to a server (nothing to protect); "
                          f"turn it off")


def _gen(pl: Plan, cfg: ExperimentConfig, *keys: int) -> torch.Generator:
    return dp.generator([cfg.seed, PRIVACY, *keys] if pl.seeded else None)


def server_aggregate(pl: Plan, cfg: ExperimentConfig, rnd: int,
                     updates: list[Params]) -> tuple[Params, dict[str, float]]:
    """The released mean delta of a round's accepted updates, and what the server logs about it
    (central mode: the fraction of updates clipped and their median norm)."""
    stats: dict[str, float] = {}
    if pl.mode == "central":
        clipped, norms = zip(*(dp.clip(u, pl.clip) for u in updates))
        total = {n: sum(c[n] for c in clipped) for n in updates[0]}
        total = dp.add_noise(total, pl.noise_multiplier * pl.clip, _gen(pl, cfg, rnd))
        srt = sorted(norms)
        stats = {"dp_clipped": sum(x > pl.clip for x in norms) / len(norms), "dp_norm": srt[len(srt) // 2]}
    else:
        total = {n: sum(u[n].double() for u in updates) for n in updates[0]}
    return {n: total[n] / pl.clients_per_round for n in updates[0]}, stats


def secure_release(pl: Plan | None, mean: Params, summed: int) -> Params:
    """The round's mean delta from a secure aggregate: the sum over m under DP's fixed weights
    (the mean of the `summed` clients × summed/m), else the aggregate as it is (FedAvg's weights)."""
    if pl is None:
        return mean
    return {n: t.double() * (summed / pl.clients_per_round) for n, t in mean.items()}


def client_release(pl: Plan, cfg: ExperimentConfig, cid: int, rnd: int, trained: Params, received: Params) -> Params:
    """Distributed mode: the GLOBAL tensors a client uploads, received + its clipped, noised update
    (noise std z·S/√m: the m shares add up to the central noise). Other modes: `trained` as is."""
    if pl.mode != "distributed":
        return trained
    update, _ = dp.clip({n: trained[n].double() - received[n].double() for n in trained}, pl.clip)
    noisy = dp.add_noise(update, pl.noise_multiplier * pl.clip / pl.clients_per_round ** 0.5,
                         _gen(pl, cfg, rnd, cid))
    return {n: (received[n].double() + noisy[n]).to(trained[n].dtype) for n in trained}


def _accountant(kind: str) -> RDPAccountant | PRVAccountant:
    from opacus.accountants import PRVAccountant, RDPAccountant  # heavy import: only when DP is on

    return RDPAccountant() if kind == "rdp" else PRVAccountant()


def epsilon(noise_multiplier: float, sample_rate: float, rounds: int, delta: float, kind: str = "rdp") -> float:
    """ε spent after `rounds` releases of the subsampled Gaussian mechanism (Opacus' `kind`
    accountant; it assumes Poisson sampling of the clients at rate `sample_rate`)."""
    if rounds <= 0:
        return 0.0
    acc = _accountant(kind)
    acc.history = [(noise_multiplier, sample_rate, rounds)]
    with warnings.catch_warnings():  # "optimal order is the largest alpha": the bound is still valid
        warnings.simplefilter("ignore", UserWarning)
        return float(acc.get_epsilon(delta=delta))


def noise_for(target_epsilon: float, delta: float, sample_rate: float, rounds: int, kind: str = "rdp") -> float:
    """The noise multiplier with which `rounds` releases spend `target_epsilon` (Opacus' search)."""
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                          sample_rate=sample_rate, steps=rounds, accountant=kind))
