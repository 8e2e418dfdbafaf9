"""results.json's tables: what a finished run reports, and the data report it starts with; the
references every run is read against and the warnings when a run did not beat them; the
end-of-run table; the line saying where a run computes."""

from __future__ import annotations

import math

from fedsplice.app.console import make_console, plural
from fedsplice.config import SITES, ExperimentConfig
from fedsplice.data.datasets import class_prompt_of
from fedsplice.data.report import data_report
from fedsplice.data.zoo import random_weights
from fedsplice.federation.dpsgd import summary as dpsgd_summary


def data_table(exp) -> dict:
    """results.json's "data": sizes per class and per client, the split, drops, warnings. With
    per-site data the server knows no site's sizes: only its own evaluation file's."""
    # the data's clients only: centralized appends a stand-in that pools the training clients'
    # data (federation.pooled.prepare_reference), which would count them twice
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


def _scalars(m: dict | None) -> dict | None:
    return None if m is None else {k: v for k, v in m.items() if not isinstance(v, (list, dict))}


def results_table(cfg: ExperimentConfig, exp, name: str, records: list[dict], final: dict,
                  refs: dict | None = None) -> dict:
    """results.json's content (the runner adds cold_start and time_s). `refs`: the run's
    input-free references (`fedsplice.federation.references`)."""
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
        # round 0's scalars: where the run started, which the results page's gate reads
        "start": {k: _scalars(records[0].get(k)) for k in ("gm", "pm")},
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
    results["references"] = refs
    results["warnings"] = learning_warnings(cfg, exp, results)
    if exp.privacy is not None:  # the ε spent by the rounds run (metrics.jsonl has it per round)
        results["privacy"] = exp.privacy.summary(rounds)
    if cfg.privacy.local == "dpsgd":  # sample-level: the largest ε any client spent (each site's in its ledger)
        results["privacy_local"] = dpsgd_summary(cfg, records)
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


def zero_shot_at_round_0(cfg: ExperimentConfig) -> bool:
    """Whether round 0 scores the zero-shot model: a zero-shot task (not a new classifier head),
    whose PEFT starts as the identity (a prompt context only when copied from the template)."""
    return cfg.model.task != "encoder_head" and not (cfg.peft.type == "prompt" and cfg.peft.prompt_init != "template")


def learning_warnings(cfg: ExperimentConfig, exp, results: dict) -> list[str]:
    """One line for each reference a finished run did not beat: GM not above the majority class,
    PM not above the local prior (each client's own majority class), zero-shot (round 0) at
    chance. None for the references themselves, or without references (per-site data)."""
    refs = results["references"]
    if cfg.model.task == "generate":
        return _generate_warnings(exp, results)
    if refs is None or exp.recipe.prior:
        return []
    out, maj, loc = [], refs["majority"], refs["local_prior"]
    gm, pm, zs = results["gm"]["accuracy"], results["pm"]["accuracy"], results["zero_shot_gm"]
    more = "more rounds (server.rounds), more local steps (client.max_steps) or a larger client.lr usually help"
    if exp.recipe.trains and gm <= maj["gm"]["accuracy"]:
        out.append(f"warning: GM accuracy {gm:.3f} is not above the majority class's {maj['gm']['accuracy']:.3f} "
                   f"(one class predicted for every input): the global model does not yet beat predicting the "
                   f"most frequent class; {more}")
    if exp.recipe.trains and pm <= loc["pm"]["accuracy"]:
        out.append(f"warning: PM accuracy {pm:.3f} is not above the local prior's {loc['pm']['accuracy']:.3f} "
                   f"(each client predicting its own majority class): the personalized models do not yet beat "
                   f"each client's most frequent class; {more}")
    tkl = results["gm"].get("tkl")
    if tkl is not None and abs(tkl) < UNMOVED_TKL and exp.recipe.trains and exp.global_names:
        out.append(f"warning: after {plural(results['rounds'], 'round')} the global model still predicts as "
                   f"zero-shot does (TKL to zero-shot {tkl:.1e}, rounding noise): either the rounds did not move "
                   f"it ({more}), or this method's GM is the zero-shot model by construction")
    if zero_shot_at_round_0(cfg):
        out += _zero_shot_warning(cfg, zs, results["data"]["global_test_per_class"], maj["gm"]["accuracy"])
    return out


def _generate_warnings(exp, results: dict) -> list[str]:
    """Free-text answers: a trained global model whose held-out response loss is not below the
    zero-shot model's (round 0) has not learned the task."""
    gm, zs = results["gm"]["response_loss"], results["zero_shot_gm"]["response_loss"]
    if exp.recipe.trains and exp.global_names and gm >= zs:
        return [f"warning: GM response loss {gm:.3f} is not below zero-shot's {zs:.3f} (round 0): the global model "
                f"does not yet answer the held-out prompts better than the base model; more rounds "
                f"(server.rounds), more local steps (client.max_steps) or a larger client.lr usually help"]
    return []


UNMOVED_TKL = 1e-7  # a GM whose TKL to zero-shot is below this predicts as zero-shot, to rounding


def _zero_shot_warning(cfg: ExperimentConfig, zs: dict, counts: list[int], majority: float) -> list[str]:
    """Zero-shot at chance: two classes, by AUC within 2 null standard errors of 0.5 (below that,
    the classes are ranked the wrong way round); more, by accuracy not above the majority class."""
    if len(counts) == 2 and zs.get("auc") is not None and not math.isnan(zs["auc"]):
        se = math.sqrt((sum(counts) + 1) / (12 * counts[0] * counts[1]))
        if zs["auc"] < 0.5 - 2 * se:
            return [f"warning: zero-shot (round 0) ranks the two classes the wrong way round on the global test "
                    f"set (AUC {zs['auc']:.3f}): {_prompt_hint(cfg)}"]
        at, said = zs["auc"] <= 0.5 + 2 * se, f"AUC {zs['auc']:.3f}"  # Hanley & McNeil's null SE
    else:
        at = zs["accuracy"] <= majority
        said = f"accuracy {zs['accuracy']:.3f}, not above the majority class's {majority:.3f}"
    if not at:
        return []
    return [f"warning: zero-shot (round 0) is at chance on the global test set ({said}): {_prompt_hint(cfg)}"]


def _prompt_hint(cfg: ExperimentConfig) -> str:
    names = "readable class names (data.class_names)"
    if cfg.model.task == "dual_encoder":
        prompt = cfg.data.class_prompt or class_prompt_of(cfg.data.dataset)
        return (f"the class prompt {prompt!r} does not tell the classes apart; a prompt that describes them "
                f"(data.class_prompt, e.g. \"a {{label}} review.\") or {names} usually help")
    return (f"the model's answers do not tell the classes apart; a question in model.input_template "
            f"(e.g. \"Review: {{text}}\\nIs it great or other?\") or {names} usually help")


def _class_rows(t, results: dict) -> None:
    for col in ("", "accuracy", "F1 macro", "std", "min"):
        t.add_column(col)
    rows = [("GM (global test)", results["gm"], False), ("PM (all clients)", results["pm"], True)]
    refs = results.get("references")
    if refs:
        rows.insert(1, ("  majority class (reference)", refs["majority"]["gm"], False))
        rows.append(("  local prior (reference)", refs["local_prior"]["pm"], True))
    for label, m, spread in rows:
        t.add_row(label, f"{m['accuracy']:.4f}", f"{m['f1_macro']:.4f}",
                  f"{m['accuracy_std']:.4f}" if spread else "", f"{m['accuracy_min']:.4f}" if spread else "")


def _answer_rows(t, results: dict) -> None:
    """model.task = "generate": the scores of fedsplice.federation.generative, zero-shot beside."""
    cols = ("response_loss", "perplexity", "exact_match", "token_f1", "rouge_l", "choice_loglik", "choice_parsed")
    for col in ("", *cols):
        t.add_column(col.replace("_", " "))
    for label, m in (("GM (global test)", results["gm"]), ("  zero-shot (round 0)", results["zero_shot_gm"]),
                     ("PM (all clients)", results["pm"])):
        t.add_row(label, *("—" if m.get(c) is None else f"{m[c]:.4f}" for c in cols))


def print_table(results: dict) -> None:
    """The end-of-run summary: GM and PM beside the references, traffic, the warnings."""
    from rich.table import Table

    t = Table(title=f"{results['algorithm']} — {results['dataset']}, {plural(results['rounds'], 'round')}")
    if "response_loss" in results["gm"]:
        _answer_rows(t, results)
    else:
        _class_rows(t, results)
    c = results["communication"]
    t.caption = (f"upload {c['up_bytes'] / 1e6:.2f} MB total, {c['up_bytes_per_round'] / 1e3:.1f} kB/round; "
                 f"download {c['down_bytes'] / 1e6:.2f} MB")
    if "privacy" in results:
        p = results["privacy"]
        t.caption += (f"\nDP ({p['mode']}): ε = {p['epsilon']:.4g} at δ = {p['delta']:g} after {p['rounds']} rounds "
                      f"(clip {p['clip']:g}, noise multiplier {p['noise_multiplier']:.3f}, q = {p['sample_rate']:.3f}, "
                      f"{p['accountant'].upper()} accountant; GLOBAL tensors only; against the server itself: "
                      + ("none, it sees clipped updates in the clear)" if p["server_view_epsilon"] is None
                         else f"ε = {p['server_view_epsilon']:.4g} without secure aggregation)"))
    if "privacy_local" in results:
        p = results["privacy_local"]
        z = (f"noise multiplier {p['noise_multiplier']:.3f}" if p["noise_multiplier"]
             else f"noise for ε {p['target_epsilon']:g} a client")
        t.caption += (f"\nDP-SGD in each client: ε ≤ {p['epsilon_max']:.4g} at δ = {p['delta']:g} for every client "
                      f"(per-example clip {p['clip']:g}, {z}, {p['accountant'].upper()} accountant; each site's ε "
                      f"in its ledger)")
    out = make_console()
    out.print(t)
    for w in results.get("warnings", []):
        out.print(w, style="bold yellow", markup=False, highlight=False, soft_wrap=True)
    if results.get("random_weights"):
        out.print(f"[bold red]RANDOM WEIGHTS ({', '.join(results['random_weights'])}): these numbers "
                  f"test the code path, not the method[/]")
