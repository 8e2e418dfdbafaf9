"""[privacy]: differential privacy. Client-level (DP-FedAvg, `mode`) on what leaves a client:
only the GLOBAL tensors travel, so only their update is clipped and noised; PRIVATE tensors never
leave a client and take no noise. Sample-level (DP-SGD, `local`) inside each client: Opacus clips
every training example's gradient of every trainable tensor and adds noise to each step.
docs/privacy.md states the guarantees and their limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedsplice.config.checks import refuse_inert
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
    # true: on Flower, the GLOBAL updates are summed by Flower's SecAgg+ (its workflow and client
    # mod): the ServerApp sees only the sum of the sampled clients' masked, quantized updates
    secure_aggregation: bool = False
    # SecAgg+ (Flower's SecAggPlusWorkflow): shares of each client's key, as a fraction (<= 1) of
    # the sampled clients or a count (> 2); shares needed to recover a dropped client (fraction of
    # the shares, or a count >= 2); each update coordinate is clipped to ±clipping_range and
    # quantized to quantization_range levels (Flower's defaults)
    secagg_num_shares: float = 1.0
    secagg_threshold: float = 0.5
    secagg_clipping_range: float = 8.0
    secagg_quantization_range: int = 4194304  # 2**22

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def check(self) -> None:
        self._check_inert()
        if self.local == "dpsgd":
            self._check_mechanism("privacy.local = 'dpsgd'", "local_", self.local_clip,
                                  "the L2 bound of one example's gradient",
                                  self.local_noise_multiplier, self.local_target_epsilon)
        if self.secure_aggregation:
            self._check_secagg()
        if self.enabled:
            self._check_mechanism(f"privacy.mode = {self.mode!r}", "", self.clip,
                                  "the L2 bound of a client's GLOBAL update",
                                  self.noise_multiplier, self.target_epsilon)

    def _check_inert(self) -> None:
        """Settings of a mechanism that is off (docs/privacy.md: what each one takes effect under)."""
        if not self.enabled:
            refuse_inert("privacy", self, ("clip", "noise_multiplier", "target_epsilon"), "privacy.mode = 'off'",
                         "set privacy.mode = 'central' or 'distributed' (client-level DP) for it to take effect")
        if self.local != "dpsgd":
            refuse_inert("privacy", self, ("local_clip", "local_noise_multiplier", "local_target_epsilon"),
                         "privacy.local = 'off'", "set privacy.local = 'dpsgd' (sample-level DP) for it to take effect")
        if not self.enabled and self.local != "dpsgd":
            refuse_inert("privacy", self, ("delta", "accountant", "noise"), "privacy.mode and privacy.local are off",
                         "turn on privacy.mode or privacy.local for it to take effect")
        if not self.secure_aggregation:
            refuse_inert("privacy", self, ("secagg_num_shares", "secagg_threshold", "secagg_clipping_range",
                                           "secagg_quantization_range"), "privacy.secure_aggregation = false",
                         "set privacy.secure_aggregation = true (on Flower) for it to take effect")

    def _check_secagg(self) -> None:
        """Flower's own checks of SecAggPlusWorkflow's arguments, as one-line errors naming the field."""
        n, t = self.secagg_num_shares, self.secagg_threshold
        if not (0 < n <= 1 or (n > 2 and float(n).is_integer())):
            raise ConfigError(f"privacy.secagg_num_shares must be a fraction in (0, 1] of the sampled clients or "
                              f"a whole count > 2, got {n}")
        if not (0 < t <= 1 or (t >= 2 and float(t).is_integer())):
            raise ConfigError(f"privacy.secagg_threshold must be a fraction in (0, 1] of the shares or a whole "
                              f"count >= 2, got {t}")
        if n > 2 and t >= 2 and t >= n:
            raise ConfigError(f"privacy.secagg_threshold ({t:g}) must be less than privacy.secagg_num_shares ({n:g})")
        if self.secagg_clipping_range <= 0:
            raise ConfigError(f"privacy.secagg_clipping_range must be > 0, got {self.secagg_clipping_range}")
        if not 0 < self.secagg_quantization_range < 2 ** 32:
            raise ConfigError(f"privacy.secagg_quantization_range must be in (0, 2**32) (the mask modulus), "
                              f"got {self.secagg_quantization_range}")
        if self.mode == "central":
            raise ConfigError("privacy.mode = 'central' clips each update on the server, which secure aggregation "
                              "hides from it: use privacy.mode = 'distributed' with privacy.secure_aggregation")

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


# What a method's training does that DP-SGD's per-example clipping cannot bound (refuse_under_dpsgd)
OWN_RULE = ("trains with a loss or gradient rule of its own, over the whole batch; Opacus clips each example's "
            "gradient of a mean loss")
OWN_STAGE = "trains a personal stage of its own outside the local steps"


def refuse_under_dpsgd(privacy: PrivacyConfig, algorithm: str, what: str) -> None:
    """One line refusing privacy.local = 'dpsgd' for `algorithm`, which `what` (OWN_RULE,
    OWN_STAGE). The plan refuses any recipe with such parts (federation.dpsgd.check); a method that
    always has them declares it in its check_config, so `validate` refuses it before the skeleton."""
    if privacy.local == "dpsgd":
        raise ConfigError(f"privacy.local = 'dpsgd': algorithm {algorithm!r} {what}: set privacy.local = 'off' "
                          f"or use another algorithm")


def refuse_own_weights(privacy: PrivacyConfig, algorithm: str) -> None:
    """One line refusing DP-FedAvg and SecAgg+, which need one weight per client, for `algorithm`,
    which weighs each tensor by its own rule (core.server.OWN_WEIGHT statistics: a method calls it
    from its check_config, as HetLoRA does; the round loop refuses such weights too)."""
    if not (privacy.enabled or privacy.secure_aggregation):
        return
    where = f"privacy.mode = {privacy.mode!r}" if privacy.enabled else "privacy.secure_aggregation = true"
    raise ConfigError(f"{where} needs one weight per client, and algorithm {algorithm!r} weighs each tensor "
                      f"by its own rule; turn it off or use another algorithm")
