"""`fedsplice export RUN OUT (--client K | --global) [--merge]`: what a run trained, in standard formats.

OUT holds, from the run's last checkpoint:

    adapter_config.json, adapter_model.safetensors   peft.type = "lora": `PeftModel.save_pretrained`
                                  (a method's own LoRA adapters in OUT/<adapter>/), so that
                                  `PeftModel.from_pretrained(base, OUT)` loads them
    fedsplice_parts.safetensors   every trained tensor PEFT has no format for, by its model name:
                                  CoOp prompts ("prompt..."), the feature adapter ("adapter..."),
                                  a linear head, a projector, FLoRA's dense ΔW, and the method's
                                  own client slot as "slot/<name>" (FedPuReL's residual branch,
                                  FedOTP's and FedPGP's local prompts live among the tensors)
    fedsplice_export.json         what it is: the run, the client, the round, the class names and
                                  class prompt, each part's kind
    config.toml                   the run's config
    merged/                       (--merge) the base with the LoRA merged in (`save_pretrained`)

`--client K`: client K's model as it uses it (GLOBAL + its PRIVATE tensors); `--global`: the
global model (GLOBAL + the PRIVATE tensors' initial values, as GM evaluates it).
`fedsplice.load_export(OUT)` rebuilds the TaskModel with everything loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fedsplice.app.rundir import write_config
from fedsplice.data.assets import atomic_write_json
from fedsplice.errors import ConfigError
from fedsplice.federation import build
from fedsplice.federation import checkpoint as ckpt
from fedsplice.federation.state import ClientState
from fedsplice.federation.validate import load_run_config

META, PARTS = "fedsplice_export.json", "fedsplice_parts.safetensors"


def _state(run: Path, client: int | None):
    """(cfg, exp with the model loaded as exported, method slot, meta) of RUN's last checkpoint."""
    if not (run / "config.toml").is_file():
        raise ConfigError(f"{run}: not a run folder (no config.toml); give the --out of a `fedsplice run`")
    cfg = load_run_config(run / "config.toml")
    last = ckpt.latest(run / ckpt.DIRNAME)
    if last is None:
        raise ConfigError(f"{run}: no checkpoint to export (runtime.checkpoint_every = 0, or the run never "
                          f"finished a round); rerun with runtime.checkpoint_every >= 1")
    exp = build(cfg)
    loaded = ckpt.load(last, cfg, exp.sampling)
    private = {n: exp.init_params[n] for n in exp.private_names}
    slot: dict[str, torch.Tensor] = {}
    stored = None
    if client is not None:
        if client not in exp.train_ids:
            raise ConfigError(f"--client {client}: the run's training clients are 0..{len(exp.train_ids) - 1}")
        stored = ClientState.from_store(loaded.clients.get(client))
        if stored is not None:
            private, slot = {**private, **stored.params}, dict(stored.method)  # packed: flat tensors
    exp.model.load_params({**loaded.state.global_params, **private})
    meta = {"run": str(run.resolve()), "client": client, "round": loaded.state.round, "algorithm": cfg.algorithm,
            "peft_type": cfg.peft.type, "base_model": cfg.model.name, "class_names": exp.data.class_names,
            "class_prompt": exp.model.class_prompt, "trained_by_client": client is None or stored is not None}
    return cfg, exp, slot, meta


def export(run: Path, out: Path, client: int | None = None, merge: bool = False) -> dict:
    """Write OUT (module docstring); returns what was written (fedsplice_export.json's content)."""
    from safetensors.torch import save_file

    run, out = Path(run), Path(out)
    cfg, exp, slot, meta = _state(run, client)
    if merge and cfg.peft.type != "lora":
        raise ConfigError(f"--merge folds LoRA into the base weights; peft.type = {cfg.peft.type!r} has no LoRA to "
                          f"merge: export without --merge")
    if merge and exp.recipe.personalize is not None and exp.recipe.personalize.predict is not None:
        raise ConfigError(f"--merge: algorithm {cfg.algorithm!r} predicts with its own rule (mixing or resetting "
                          f"adapters), which one merged weight cannot hold; export without --merge")
    out.mkdir(parents=True, exist_ok=True)
    infos = exp.model.param_infos()
    in_peft = {n for n, i in infos.items() if i.factor is not None}  # LoRA's A and B: peft saves these
    if cfg.peft.type == "lora":
        exp.model.backbone.save_pretrained(str(out))
    parts = {n: t.detach().to("cpu").contiguous() for n, t in exp.model.trainable().items() if n not in in_peft}
    parts.update({f"slot/{k}": v.detach().to("cpu").contiguous() for k, v in slot.items()})
    meta["parts"] = {n: infos[n].kind if n in infos else "method slot" for n in sorted(parts)}
    meta["lora_tensors"] = len(in_peft)
    if parts:
        save_file(parts, str(out / PARTS))
    write_config(out, cfg)
    if merge:
        merged = exp.model.backbone.merge_and_unload()
        merged.save_pretrained(str(out / "merged"))
        exp.model.tokenizer.save_pretrained(str(out / "merged"))
        meta["merged"] = "merged"
    atomic_write_json(out / META, meta)
    return meta


def write_adapter(exp, global_params: dict[str, torch.Tensor], out: Path) -> Path:
    """The global model's LoRA (GLOBAL tensors as given, PRIVATE ones at their initial values, as
    GM scores it) as PeftModel.save_pretrained writes it: adapter_config.json and
    adapter_model.safetensors in `out` (another adapter of the method in out/<name>/), so that
    `PeftModel.from_pretrained(base, out)` loads it. Read from the tensors given, never from the
    model, so a run's model is left as it is; written whole or not at all (a temporary folder
    renamed). A generate model's config says task_type CAUSAL_LM, as FlowerTune's does."""
    import dataclasses
    import shutil

    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    bb = exp.model.backbone
    params = {**{n: exp.init_params[n] for n in exp.private_names}, **global_params}
    state = {n.removeprefix("backbone."): t for n, t in params.items() if n.startswith("backbone.")}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, pc in bb.peft_config.items():
        where = tmp if name == "default" else tmp / name
        where.mkdir(parents=True, exist_ok=True)
        tensors = get_peft_model_state_dict(bb, state_dict=state, adapter_name=name)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                  str(where / "adapter_model.safetensors"))
        causal = exp.cfg.model.task == "generate" and pc.task_type is None
        (dataclasses.replace(pc, task_type="CAUSAL_LM") if causal else pc).save_pretrained(str(where))
    shutil.rmtree(out, ignore_errors=True)  # a resumed run writes a round's folder again
    tmp.rename(out)
    return out


def load_export(path) -> torch.nn.Module:
    """The TaskModel of an export folder, with its adapters and parts loaded: `predict(texts, bs)`
    gives the exported model's logits (a method's own PM rule, such as FedPuReL's branch, is
    not applied: its tensors are in the parts file under "slot/")."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights
    from safetensors.torch import load_file

    from fedsplice.model.taskmodel import TaskModel

    path = Path(path)
    if not (path / META).is_file():
        raise ConfigError(f"{path}: not a fedsplice export (no {META}); make one with "
                          f"`fedsplice export RUN OUT --global`")
    meta = json.loads((path / META).read_text())
    cfg = load_run_config(path / "config.toml")
    model = TaskModel(cfg, meta["class_names"], meta["class_prompt"])
    if cfg.peft.type == "lora":
        for name in model.backbone.peft_config:
            where = path if name == "default" else path / name
            set_peft_model_state_dict(model.backbone, load_peft_weights(str(where)), adapter_name=name)
    if (path / PARTS).is_file():
        model.load_params({n: t for n, t in load_file(str(path / PARTS)).items() if not n.startswith("slot/")})
    return model.eval()
