"""Many clients, one base model (issue 50): every client's personalized model (PM) scored in one
pass over the union of their local test sets, each row through its own client's LoRA factors
(model.grouped), instead of one predict per client.

runtime.batch_eval: "auto" batches where `batching.eval_refusal` finds nothing in the way (the
in-process runtime, which calls `evaluate` here); "on" requires it (validate refuses a config it
cannot apply to, with the reason); "off" (the default) scores each client alone. The metrics are
those of `tasks.evaluate` client by client, within float rounding (tests/test_grouped.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedsplice.federation.evaluation import score, zero_shot_cached
from fedsplice.federation.state import ClientState
from fedsplice.federation.tasks import split_state
from fedsplice.model.grouped import Owned, grouped, lora_modules, stacked

if TYPE_CHECKING:
    from fedsplice.core.server import Params
    from fedsplice.federation.experiment import Experiment
    from fedsplice.federation.metrics import Metrics
    from fedsplice.federation.store import Store

# Clients scored in one pass: benchmarks/batched_clients.py's gain flattens past 8 (1.21x at 4,
# 1.27x at 8 in fp32), while the stacked factors grow with every client.
CHUNK = 8


def evaluate(exp: Experiment, store: Store, cids: list[int], global_params: Params) -> dict[int, Metrics]:
    """tasks.evaluate of every client in `cids`, CHUNK clients a pass."""
    out: dict[int, Metrics] = {}
    for i in range(0, len(cids), CHUNK):
        out.update(_chunk(exp, store, cids[i:i + CHUNK], global_params))
    return out


def _chunk(exp: Experiment, store: Store, cids: list[int], global_params: Params) -> dict[int, Metrics]:
    d = exp.data
    models = [{**global_params, **split_state(exp, ClientState.from_store(store.get(c)))[0]} for c in cids]
    cached = {c: zero_shot_cached(exp, p, exp.clients[c].test_idx) for c, p in zip(cids, models)}
    logits = {c: z for c, z in cached.items() if z is not None}
    todo = [k for k, c in enumerate(cids) if c not in logits]
    if todo:
        factors = stacked(lora_modules(exp.private_names), [models[k] for k in todo])
        texts = [Owned(d.test_texts[i], j) for j, k in enumerate(todo) for i in exp.clients[cids[k]].test_idx]
        exp.model.load_params(models[todo[0]])  # the GLOBAL tensors every client shares
        with grouped(exp.model, factors):
            union = exp.model.predict(texts, exp.cfg.eval.batch_size).numpy()
        start = 0
        for k in todo:
            n = len(exp.clients[cids[k]].test_idx)
            logits[cids[k]], start = union[start:start + n], start + n
    return {c: score(exp, d.test_labels[exp.clients[c].test_idx], logits[c], exp.clients[c].test_idx)
            for c in cids}
