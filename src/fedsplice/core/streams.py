"""Every random stream of a run, declared in one place.

All randomness derives from the config's one seed; nothing seeds a global RNG in a constructor.

Federation's streams: each use draws from its own numpy generator, `rng(cfg, STREAM, *keys)`
(SeedSequence entropy [seed, STREAM, *keys]), so two algorithms run with the same seed see the
same partition, local test sets and sampled clients, and a resumed run draws what an
uninterrupted one would. Dropout draws from torch's global RNG, which is reseeded before every
local training (`seed_torch`). The stages after the rounds key the client stream with round
numbers outside 1..rounds; the values are those of earlier releases, kept so that results
reproduce bytewise.

Below federation, by the modules that draw them (same seed, their own generators):
- the data split of a data set: `np.random.default_rng(seed)` (`data.datasets.load_dataset`);
- scenario noise: `np.random.default_rng([seed, SCENARIO_NOISE, *sha256(sample key)])` per sample
  (`data.scenarios.gaussian_noise`), so the same sample gets the same pixels in every run;
- trainable initial values: one `torch.Generator` seeded with `seed` for prompts, adapters and
  heads, in a fixed order (`model.taskmodel`); LoRA's A under `torch.manual_seed(seed)` inside a
  forked RNG (`model.peft.inject_lora`); the VLM projector from `seed + PROJECTOR` (`model.taskmodel`).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

PARTITION, SAMPLING, CLIENT, LOCAL_TEST, FAULTS, LONG_TAIL, SCENARIO, VALIDATION = 0, 1, 2, 3, 4, 5, 6, 7
METHOD = 8  # a method's own draws on a client (ClientOps.rng): [seed, METHOD, client, key]
PRIVACY = 9  # DP noise under privacy.noise = "seeded": [seed, PRIVACY, round] (+ client, distributed)

COLD_START_ROUND = 10**6  # client stream of cold-start epoch e: round key COLD_START_ROUND + e
PERSONALIZE_ROUND = 10**7  # client stream of FedPuReL's phase 2
PERSONALIZE_TORCH_ROUND = -(10**6)  # torch seed of phase 2 (cold-start epoch e uses round -e)

SCENARIO_NOISE = 0x5CE7A410  # the per-sample Gaussian-noise stream of scenarios
PROJECTOR = 7919  # the projector's own stream: text-side inits stay as without a vision tower


class Seeded(Protocol):
    """What the streams read of a config (an ExperimentConfig: core imports no config)."""

    @property
    def seed(self) -> int: ...


def rng(cfg: Seeded, *stream: int) -> np.random.Generator:
    return np.random.default_rng([cfg.seed, *stream])


def seed_torch(cfg: Seeded, rnd: int, cid: int) -> None:
    """Dropout (if any) draws from torch's global RNG: fix it per (seed, round, client)."""
    torch.manual_seed(hash((cfg.seed, rnd, cid)) & 0x7FFFFFFF)
