"""results.json's tables: what a finished run reports, and the data report it starts with; the
line saying where a run computes."""

from __future__ import annotations

from fedsplice.config import SITES, ExperimentConfig
from fedsplice.data.report import data_report
from fedsplice.data.zoo import random_weights


def data_table(exp) -> dict:
    """results.json's "data": sizes per class and per client, the split, drops, warnings. With
    per-site data the server knows no site's sizes: only its own evaluation file's."""
    # the data's clients only: centralized appends a stand-in that pools the training clients'
    # data (federation.tasks.prepare_reference), which would count them twice
    rep = data_report(exp.data, exp.clients[:exp.cfg.data.num_clients], exp.holdout_ids)
    if len(exp.clients) > exp.cfg.data.num_clients:
        rep["notes"] = rep["notes"] + [f"one model trains on the pooled data of the {len(exp.train_ids)} "
                                       f"training clients (nothing is federated)"]
    if exp.cfg.data.dataset == SITES:
        rep.update(clients=[], train_size=None, train_per_class=None,
                   notes=rep["notes"] + ["per-site data: each site's sizes stay on its SuperNode"])
    return rep


def _counts(train_counts) -> dict:
    if train_counts is None:  # per-site data: the server holds no class counts
        return {"train_counts": None, "imbalance_measured": None}
    return {"train_counts": train_counts.tolist(),
            "imbalance_measured": float(train_counts.max() / max(train_counts.min(), 1))}


def results_table(cfg: ExperimentConfig, exp, name: str, records: list[dict], final: dict) -> dict:
    """results.json's content (the runner adds cold_start and time_s)."""
    last = records[-1]
    rounds = cfg.server.rounds if exp.recipe.trains else 0
    results = {
        "algorithm": name,
        "method": cfg.algorithm,
        "server_optimizer": cfg.server.optimizer,
        "rounds": rounds,
        "seed": cfg.seed,
        "model": cfg.model.name,
        **({"vision": cfg.model.vision} if cfg.model.vision else {}),
        "random_weights": random_weights(cfg),  # non-empty: results of random models, not of the method
        "dataset": cfg.data.dataset,
        "num_classes": len(exp.data.class_names),
        **_counts(exp.caches["train_counts"]),
        "gm": last["gm"],
        "pm": last["pm"],
        "zero_shot_gm": records[0]["gm"],
        "communication": {
            "up_bytes": final["up_bytes"], "down_bytes": final["down_bytes"],
            "up_bytes_per_round": final["up_bytes"] / max(rounds, 1),
            "down_bytes_per_round": final["down_bytes"] / max(rounds, 1),
            "up_bytes_per_client_round": final["up_bytes"] / max(rounds * cfg.server.clients_per_round, 1),
        },
        "params": {"global": sum(exp.init_params[n].numel() for n in exp.global_names),
                   "private": sum(exp.init_params[n].numel() for n in exp.private_names)},
        "failures": {**{k: sum(r.get(k, 0) for r in records) for k in ("dropped", "late", "rejected")},
                     "skipped_rounds": sum(bool(r.get("skipped")) for r in records)},
    }
    results["data"] = data_table(exp)
    purified = [r["purified_steps"] for r in records if "purified_steps" in r]
    if purified:
        results["purified_fraction"] = float(sum(purified) / len(purified))
    return results


def hardware_line(cfg: ExperimentConfig, exp) -> str:
    """Where the run computes, with what "auto" resolved to: "device cpu, bf16 autocast (auto), ..."."""
    amp = {"torch.float32": "fp32", "torch.bfloat16": "bf16 autocast", "torch.float16": "fp16 autocast"}
    rc, mc = cfg.runtime, cfg.model
    parts = [f"device {exp.model.device}" + (" (auto)" if rc.device == "auto" else ""),
             amp[str(exp.model.amp_dtype)] + (" (auto)" if rc.precision == "auto" else "")]
    if mc.dtype != "fp32" or mc.quantization != "none":
        parts.append(f"base weights {mc.quantization if mc.quantization != 'none' else mc.dtype}")
    if mc.gradient_checkpointing:
        parts.append("gradient checkpointing")
    if rc.workers > 1:
        parts.append(f"{rc.workers} worker processes")
    return ", ".join(parts)
