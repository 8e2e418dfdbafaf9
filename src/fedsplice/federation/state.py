"""`ClientState`: what one client keeps between its tasks, typed.

A `Store` holds it as one name-keyed tensor dict (the store, checkpoint and SuperNode format),
each slot's tensors under its prefix: "param/<name>", "opt/<name>/<slot>", "ef/<name>",
"switch/<switch>/<key>", "method/<name>", "dp/<key>". Only this module reads or writes the prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from fedsplice.algorithms.switches import SWITCHES

Tensors = dict[str, torch.Tensor]


@dataclass
class ClientState:
    params: Tensors = field(default_factory=dict)  # PRIVATE tensors
    opt: Tensors = field(default_factory=dict)  # their optimizer state ("<name>/<slot>"), if kept
    ef: Tensors = field(default_factory=dict)  # the int8 upload's error-feedback residual (never sent)
    switch: Tensors = field(default_factory=dict)  # the switches' state ("<switch>/<key>": a balancer's sums)
    # the method's own state (Recipe.state), packed (fedsplice.algorithms.state): FedPuReL's branch,
    # HetLoRA's rank
    method: Tensors = field(default_factory=dict)
    dp: Tensors = field(default_factory=dict)  # DP-SGD's steps so far (federation.dpsgd), never sent

    # slot -> prefix in the store's tensor dict, in the order they are written
    PREFIXES = {"params": "param/", "opt": "opt/", "ef": "ef/", "switch": "switch/", "method": "method/",
                "dp": "dp/"}

    @classmethod
    def from_store(cls, tensors: Tensors | None) -> ClientState | None:
        """The state a store returned (None: the client has none yet)."""
        if tensors is None:
            return None
        slots: dict[str, Tensors] = {f.name: {} for f in fields(cls)}
        for key, t in tensors.items():
            key = legacy(key)
            slot = next((s for s, p in cls.PREFIXES.items() if key.startswith(p)), None)
            if slot is None:
                raise ValueError(f"client state key {key!r} is in no slot ({', '.join(cls.PREFIXES.values())}); "
                                 f"a store written by another fedsplice version?")
            slots[slot][key[len(cls.PREFIXES[slot]):]] = t
        return cls(**slots)

    def to_store(self) -> Tensors:
        return {f"{p}{k}": t for slot, p in self.PREFIXES.items() for k, t in getattr(self, slot).items()}

    def kept_by(self, switch: str) -> Tensors:
        """What the client kept of one switch ({} if nothing)."""
        return {k[len(switch) + 1:]: t for k, t in self.switch.items() if k.startswith(switch + "/")}


def legacy(key: str) -> str:
    """A key of a store written before the switches and the typed method state (a checkpoint of
    an earlier version, resumed): the method's slot was "branch/", a switch's state "<switch>/"."""
    head = key.split("/", 1)[0]
    if head == "branch":
        return "method/" + key[len("branch/"):]
    return f"switch/{key}" if head in SWITCHES else key


def switch_state(kept: dict[str, Tensors]) -> Tensors:
    """{switch: its state} as the `switch` slot."""
    return {f"{name}/{k}": t for name, state in kept.items() for k, t in state.items()}
