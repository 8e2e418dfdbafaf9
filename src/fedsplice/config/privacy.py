"""[privacy]: differential privacy. Client-level (DP-FedAvg, `mode`) on what leaves a client:
only the GLOBAL tensors travel, so only their update is clipped and noised; PRIVATE tensors never
leave a client and take no noise. Sample-level (DP-SGD, `local`) inside each client: Opacus clips
every training example's gradient of every trainable tensor and adds noise to each step.
docs/privacy.md states the guarantees and their limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedsplice.errors import ConfigError


@dataclass
class PrivacyConfig:
    # off; central: the server clips each client's GLOBAL update and adds the noise once to the
    # clipped sum; distributed: each client clips its own and adds a 1/m share of the noise
    # variance (m = server.clients_per_round), so that the sum carries the full noise
    mode: Literal["off", "central", "distributed"] = "off"
    clip: float = 0.0  # S: the L2 bound of one client's whole GLOBAL update (all tensors together)
    noise_multiplier: float = 0.0  # z: the sum's noise is N(0, (z·S)^2) per coordinate
    target_epsilon: float = 0.0  # > 0: z is chosen so that the planned rounds spend this ε
    delta: float = 1e-5
    accountant: Literal["rdp", "prv"] = "rdp"  # Opacus' accountants
    # secure: noise from the OS's entropy (a deployment); seeded: from the run's seed, so that a
    # run reproduces (research; whoever has the config can subtract the noise: no guarantee)
    noise: Literal["secure", "seeded"] = "secure"
    # dpsgd: every local step of every client is DP-SGD (Abadi et al. 2016) through Opacus: each
    # example's gradient clipped to local_clip, N(0, (z·local_clip)²) added to their sum; each
    # client's own accountant (q = batch_size / its examples, δ = delta) gives its ε
    local: Literal["off", "dpsgd"] = "off"
    local_clip: float = 1.0  # C: the L2 bound of one example's gradient (all trainable tensors)
    local_noise_multiplier: float = 0.0  # z of every DP-SGD step
    # > 0: each client's z is chosen so that a client trained in every planned round spends this ε
    local_target_epsilon: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def check(self) -> None:
        if self.local == "dpsgd":
            self._check_mechanism("privacy.local = 'dpsgd'", "local_", self.local_clip,
                                  "the L2 bound of one example's gradient",
                                  self.local_noise_multiplier, self.local_target_epsilon)
        if self.enabled:
            self._check_mechanism(f"privacy.mode = {self.mode!r}", "", self.clip,
                                  "the L2 bound of a client's GLOBAL update",
                                  self.noise_multiplier, self.target_epsilon)

    def _check_mechanism(self, what: str, prefix: str, clip: float, bound: str, z: float, target: float) -> None:
        """One Gaussian mechanism's settings (`prefix`: its field names' prefix, "" or "local_")."""
        f = {k: f"privacy.{prefix}{k}" for k in ("clip", "noise_multiplier", "target_epsilon")}
        if clip <= 0:
            raise ConfigError(f"{f['clip']} must be > 0 ({bound}), got {clip}")
        if z < 0 or target < 0:
            raise ConfigError(f"{f['noise_multiplier']} and {f['target_epsilon']} must be >= 0")
        if z > 0 and target > 0:
            raise ConfigError(f"{f['noise_multiplier']} and {f['target_epsilon']} are both set: keep one "
                              f"({prefix}target_epsilon chooses the noise multiplier)")
        if z == 0 and target == 0:
            raise ConfigError(f"{what} with no noise gives no privacy (ε = ∞): set {f['noise_multiplier']} > 0 "
                              f"or {f['target_epsilon']} > 0")
        if not 0 < self.delta < 1:
            raise ConfigError(f"privacy.delta must be in (0, 1), e.g. 1e-5, got {self.delta}")
