"""TaskModel: a frozen Hugging Face backbone, its trainable PEFT modules and a task scorer, as one
nn.Module that the federation layer trains and evaluates by parameter name.

It composes parts with one job each:
  loading   the HF model, tokenizer and role map, and the config checks (model.loading)
  peft      LoRA, prompt learners, adapter, head; param_infos and LoRA scalings (model.peft)
  caches    token, frozen-prefix, frozen-feature and vision-token caches (model.cache, .prefix)
  encoders  the text, class and input sides of a dual encoder (model.encoders)
  scorers   one per task: dual_encoder, encoder_head, causal_lm, vlm (model.scorers)

The trainable modules are attributes of this module (backbone, prompt, adapter, head,
projector, the modules a method adds through its `PromptParts`; the frozen vision tower too), so
parameter names — the keys on the wire and in checkpoints — are those attribute paths. The other
parts are plain objects holding references.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from fedsplice.algorithms import lora_parts, prompt_parts
from fedsplice.config import ExperimentConfig
from fedsplice.core import streams
from fedsplice.core.split import ParamInfo
from fedsplice.data.datasets import class_prompt_of
from fedsplice.errors import ConfigError
from fedsplice.model import peft, scorers
from fedsplice.model.adapters import PromptLearner
from fedsplice.model.answers import Answering
from fedsplice.model.cache import FrozenCache, TokenCache
from fedsplice.model.device import DTYPES, autocast, resolve_device
from fedsplice.model.encoders import ClassSide, InputSide, TextEncoder
from fedsplice.model.generate import Encoded
from fedsplice.model.loading import Backbone, load_backbone, run_precision
from fedsplice.model.prefix import TextPrefix, build_image_prefix, text_prefix_layer, wants_image_prefix
from fedsplice.model.unpad import CPU_OVERHEAD
from fedsplice.model.vision import Projector, load_vision_tower

if TYPE_CHECKING:
    from collections.abc import Mapping

    from transformers import CLIPModel


class TaskModel(nn.Module):
    # set to None first, then built by task (_build_trainables); declared for their real types
    vision: nn.Module | None
    projector: Projector | None

    def __init__(self, cfg: ExperimentConfig, class_names: list[str], class_prompt: str = "", skeleton: bool = False):
        """class_prompt: the class side's template; empty: data.class_prompt, else the data set's own.
        `skeleton`: the backbone and the trainable modules on the meta device (no weight read,
        nothing allocated): their names, shapes and LoRA scalings for a plan
        (fedsplice.federation.plan); such a model never runs."""
        super().__init__()
        self.class_prompt = class_prompt or cfg.data.class_prompt or class_prompt_of(cfg.data.dataset)
        self.task = cfg.model.task
        self.mcfg = cfg.model
        self.pcfg = cfg.peft
        self.class_names = list(class_names)
        self.device, self.amp_dtype = self._placement(cfg, skeleton)
        if cfg.model.dtype != "fp32" and self.amp_dtype != DTYPES[cfg.model.dtype]:
            raise ConfigError(f"model.dtype = {cfg.model.dtype!r} runs the fp32 adapters beside a "
                              f"{cfg.model.dtype} base under autocast: set runtime.precision = "
                              f"{cfg.model.dtype!r} (it resolved to "
                              f"{str(self.amp_dtype).removeprefix('torch.')})")
        if self.device.type == "cuda" and self.device.index is not None and not skeleton:
            torch.cuda.set_device(self.device)  # libraries that allocate on "the current device" follow
        self.checkpointing = cfg.model.gradient_checkpointing
        bb = load_backbone(cfg, self.device, meta=skeleton)
        self.tokenizer, self.rmap, self.is_clip = bb.tokenizer, bb.rmap, bb.is_clip
        self.image_processor, self.vision, self.projector = bb.image_processor, None, None
        self._parts = prompt_parts(cfg)  # what the method adds to a prompt model (None: nothing)
        with torch.device("meta") if skeleton else nullcontext():  # a plan allocates no trainable tensor
            self._build_trainables(cfg, bb, skeleton)
        # CLIP with LoRA in its text tower: the class side changes as it trains; full fine-tuning
        # keeps no frozen copy of the encoder, so the class side goes through the trained one
        pc = cfg.peft
        self._trains_text = cfg.model.class_side_adapters or pc.type == "full" or (
            self.is_clip and pc.type == "lora" and pc.tower != "vision_model")
        self.class_side_trains = self._trains_text or pc.type == "prompt"  # its tensors see classes, not examples
        if skeleton:
            return
        self._zero_shot = False
        self._per_sample = False  # per_sample(): each example's own gradient is taken (DP-SGD)
        self.cache_on = cfg.runtime.cache
        # the base was placed as it loaded (device_map; a quantized one cannot move afterwards)
        # and peft put its LoRA beside it; everything else moves now
        for name, mod in self.named_children():
            if name != "backbone" or cfg.model.quantization == "none":
                mod.to(self.device)
        self._build_parts(cfg, bb)

    @staticmethod
    def _placement(cfg: ExperimentConfig, skeleton: bool) -> tuple[torch.device, torch.dtype]:
        """(device, autocast dtype of every forward and the backward under it; trainable tensors
        stay fp32). A skeleton may be planned on another machine than the one that runs: a
        device this machine lacks is then planned as the CPU, with runtime.precision's own
        dtype ("auto": fp32)."""
        try:
            device = resolve_device(cfg.runtime.device)
        except ConfigError:
            if not skeleton:
                raise
            auto = cfg.runtime.precision == "auto"
            return torch.device("cpu"), torch.float32 if auto else DTYPES[cfg.runtime.precision]
        return device, run_precision(cfg, device)

    def _build_trainables(self, cfg: ExperimentConfig, bb: Backbone, meta: bool = False) -> None:
        """The modules holding trainable parameters, registered in a fixed order (it is the order
        of trainable()) and drawing their inits in a fixed order from one seeded generator."""
        pc = cfg.peft
        gen = torch.Generator().manual_seed(cfg.seed)
        self.prompt = self.adapter = self.head = None
        if pc.type == "lora":
            self.backbone = peft.inject_lora(bb.model, self.rmap, pc, cfg.seed, bb.model_type, lora_parts(cfg))
        else:
            self.backbone = peft.unfreeze(bb.model) if pc.type == "full" else bb.model
        if pc.type == "prompt":
            we: nn.Embedding
            if self.is_clip:
                we = cast("CLIPModel", bb.model).text_model.embeddings.token_embedding
            else:  # an HF text model's input embeddings are an nn.Embedding (HF types them nn.Module)
                we = cast(nn.Embedding, bb.model.get_input_embeddings())
            built = peft.build_prompts(self.tokenizer, we, self.class_prompt, self.class_names, pc, gen,
                                       bb.text_positions, self._parts)
            for name, module in built.items():
                if name != "prompt" and hasattr(self, name):
                    raise ConfigError(f"algorithm {cfg.algorithm!r}: its PromptParts.modules names {name!r}, "
                                      f"an attribute the model already has; rename it")
                setattr(self, name, module)
            self._method_modules = built
        if pc.type == "adapter":
            self.adapter = peft.build_adapter(bb.hidden, pc, gen)
        if self.task == "encoder_head":
            self.head = peft.build_head(bb.hidden, len(self.class_names), gen)
        if pc.type == "lora":
            peft.check_roles(self.param_infos(), pc.roles, bb.model_type, self.rmap)
        if self.task == "vlm" or cfg.model.vision:  # generate with model.vision: the VLM path too
            self.vision, self.image_processor, vh = load_vision_tower(cfg.model.vision, DTYPES[cfg.model.dtype], meta)
            pgen = torch.Generator().manual_seed(cfg.seed + streams.PROJECTOR)
            self.projector = Projector(vh, bb.hidden, cfg.model.projector, pgen)

    def _build_parts(self, cfg: ExperimentConfig, bb: Backbone) -> None:
        """Caches, encoders and the task's scorer: plain objects over the modules built above."""
        pc, rc = cfg.peft, cfg.runtime
        max_len = self.mcfg.max_length if bb.text_positions is None else min(self.mcfg.max_length, bb.text_positions)
        self._tok = TokenCache(self.tokenizer, max_len, rc.cache, self.device)
        # a plain object, like every part below: a module attribute here would register the HF
        # model a second time (under another name in state_dict)
        self._text = TextEncoder(self.backbone, peft.hf_model(self.backbone, pc.type), self._tok, self.is_clip)
        self._init_prefix_cache(cfg, text_prefix_layer(cfg, self.is_clip))
        self._img_prefix = None
        if wants_image_prefix(cfg, self.is_clip):
            self._img_prefix = build_image_prefix(cfg, bb.model, self.image_processor)
        trains_text = self._trains_text
        self._classes = ClassSide(self._text, self.class_names, [self.class_prompt, *cfg.data.class_prompts],
                                  pc.type, trains_text, self.cache_on, self.prompt)
        parts = self._parts
        if parts is not None:  # the method composes the class side from its prompt modules
            self._classes.compose = lambda: parts.class_embeddings(self._classes.from_prompt, self._method_modules)
        lm_task = self.task in ("causal_lm", "vlm", "generate")
        # prompt/adapter: the input side is frozen whole, so its pooled features are cached
        features = (FrozenCache({"kind": "features"}, 1 << 62, device=self.device)
                    if rc.cache and pc.type in ("prompt", "adapter") and not lm_task else None)
        # CLIP images through the whole tower each step (no frozen prefix): their pixels, once
        self._pixels = (FrozenCache({"kind": "pixels"}, rc.cache_budget_mb << 20, device=self.device)
                        if rc.cache and self.is_clip and self._img_prefix is None else None)
        clip_inputs = (InputSide.clip(self._text, self.image_processor, self._img_prefix,
                                      self.cache_on and not trains_text, self._pixels) if self.is_clip else None)
        self._inputs = InputSide(self._text, pc.type, self.adapter, features, clip_inputs)
        if self._method_scorer() is not None:  # the frozen input tower's token features, if it reads them
            self._inputs.token_cache = (FrozenCache({"kind": "tokens"}, rc.cache_budget_mb << 20, device=self.device)
                                        if rc.cache else None)
        # vlm: the frozen vision tower's tokens, per image (keyed by its pixels: vision.image_key)
        self._vis = (FrozenCache({"kind": "vision"}, rc.cache_budget_mb << 20, device=self.device)
                     if rc.cache and self.vision is not None else None)
        self._scorer = self._build_scorer()
        self._answering = Answering(lambda: self._lm, self.tokenizer, self.mcfg, self._image_tokens())
        self._unpad = rc.unpad
        self._set_unpad(self.training)

    def _method_scorer(self):
        return self._parts.scorer if self._parts is not None and self.task == "dual_encoder" else None

    def _build_scorer(self):
        if (score := self._method_scorer()) is not None:
            return scorers.MethodScorer(self._inputs, self._classes, self.mcfg.logit_scale, score)
        if self.task == "dual_encoder":
            return scorers.DualEncoderScorer(self._inputs, self._classes, self.mcfg.logit_scale)
        if self.task == "encoder_head":
            return scorers.EncoderHeadScorer(self._inputs, self.head)
        lm = scorers.CausalLMScorer(self.backbone, self.tokenizer, self.class_names, self.mcfg.input_template,
                            self.mcfg.max_length)
        if self.task == "vlm":
            return scorers.VLMScorer(lm, self._image_tokens())
        return lm

    def _image_tokens(self) -> scorers.ImageTokens | None:
        if self.vision is None or self.projector is None:
            return None
        return scorers.ImageTokens(self.vision, self.image_processor, self.projector, self._vis)

    def _init_prefix_cache(self, cfg: ExperimentConfig, l0: int) -> None:
        """(Re)build the frozen-prefix cache for first adapted layer l0 (0: none)."""
        prefix = TextPrefix.build(cfg, self.backbone, self._text.hf, self._tok, l0) if l0 > 0 else None
        if prefix is not None:
            self._text.prefix = prefix

    # ----------------------------------------------------------------- modes
    def train(self, mode: bool = True):
        """The frozen backbone always runs as at inference (no dropout): its work is then a pure
        function of the input, which makes caching it exact (docs/design.md §7). The adapters' own
        dropout (peft.dropout) and the trainable modules follow `mode`. peft.type = "full" keeps
        this too: the whole backbone trains, without dropout, like LoRA's base."""
        super().train(mode)
        self._set_unpad(mode)
        self.backbone.eval()
        if self.vision is not None:
            self.vision.eval()
        ckpt: tuple[type[nn.Module], ...] = ()
        if self.checkpointing:  # transformers is imported lazily (importing fedsplice stays fast)
            from transformers.modeling_layers import GradientCheckpointingLayer
            ckpt = (GradientCheckpointingLayer,)
        for name, mod in self.backbone.named_modules():
            if "lora_dropout" in name:
                mod.train(mode)
            elif self._per_sample and any(p.requires_grad for p in mod.parameters(recurse=False)):
                mod.training = mode  # Opacus records a module's inputs only in training (no-op modules here)
            elif ckpt and isinstance(mod, ckpt):
                mod.training = mode  # HF checkpoints a layer only in training; its dropouts stay off
        return self

    def _set_unpad(self, training: bool) -> None:
        """runtime.unpad for this mode: "auto" unpads on the CPU (benchmarks/unpad.py), but not
        while LoRA dropout trains (its masks are drawn per padded position: another stream)."""
        on = not (training and self._per_sample) and (self._unpad == "on" or (
            self._unpad == "auto" and self.device.type == "cpu" and not (training and self.pcfg.dropout > 0)))
        self._text.overhead = CPU_OVERHEAD if on else None
        lm = self._scorer.lm if isinstance(self._scorer, scorers.VLMScorer) else self._scorer
        if isinstance(lm, scorers.CausalLMScorer):
            lm.overhead = self._text.overhead
        self._answering.overhead = self._text.overhead

    @contextmanager
    def per_sample(self):
        """A context in which training batches stay padded, one row per example, and the trainable
        modules inside the frozen backbone count as training: Opacus (DP-SGD) then sees each
        example's inputs to every trainable layer."""
        self._per_sample = True
        self.train(self.training)
        try:
            yield self
        finally:
            self._per_sample = False
            self.train(self.training)

    @contextmanager
    def zero_shot(self):
        """Score with the frozen model alone: no LoRA, no adapter, the template class prompts.
        peft.type = "full" has no frozen model to fall back to: this is the pretrained model only
        before training (the build's zero-shot caches); algorithms that need it while training are
        refused with "full" (algorithms.registry)."""
        self._zero_shot = True
        try:
            with peft.adapters_off(self.backbone, self.pcfg.type):
                yield self
        finally:
            self._zero_shot = False

    # ----------------------------------------------------------------- parameters by name
    def trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def param_infos(self) -> dict[str, ParamInfo]:
        return peft.param_infos(self.trainable(), self.rmap)

    def scalings(self) -> dict[str, float]:
        """LoRA scaling s (alpha/r, or alpha/sqrt(r) with rsLoRA) for each LoRA tensor name."""
        return peft.lora_scalings(self.named_modules())

    @torch.no_grad()
    def load_params(self, tensors: Mapping[str, torch.Tensor]) -> None:
        params = dict(self.named_parameters())
        for n, t in tensors.items():
            if params[n].shape != t.shape:
                hint = (" (model.vision: a projector built for another vision tower's hidden size)"
                        if n.startswith("projector.") else "")
                raise ConfigError(f"{n}: tensor of shape {tuple(t.shape)} does not fit the model's "
                                  f"{tuple(params[n].shape)}{hint}; load it into the model it came from")
            params[n].copy_(t)

    # ----------------------------------------------------------------- scoring
    def class_embeddings(self) -> torch.Tensor:
        return self._classes.embeddings(self._zero_shot)

    def encode_prompt(self, learner: PromptLearner, ctx: torch.Tensor | None = None) -> torch.Tensor:
        """Normalized class embeddings [C, D] of a CoOp learner's class sequences around `ctx` (a
        context of the learner's shape; None: its own): for a method's objective that scores
        several views of its prompts (PromptParts.class_embeddings gets the same encoder)."""
        return self._classes.from_prompt(learner, ctx)

    def encode_prompts(self, ctxs: list[torch.Tensor]) -> torch.Tensor:
        """encode_prompt of the model's CoOp learner around each context in `ctxs` (one per
        client), in one forward: [len(ctxs), C, D] (federation.batched_train)."""
        assert self.prompt is not None, "peft.type = 'prompt' builds the learner"
        return self._classes.from_prompts(self.prompt, ctxs)

    def template_class_embeddings(self) -> torch.Tensor:
        """The frozen model's class embeddings [C, D] from the class prompt's words (zero-shot)."""
        return self._classes.frozen()

    def forward(self, texts: list, class_emb: torch.Tensor | None = None) -> torch.Tensor:
        return self._scorer(texts, class_emb, self._zero_shot)

    def autocast(self):
        """The run's precision (runtime.precision) on the model's device."""
        return autocast(self.device, self.amp_dtype)

    @torch.no_grad()
    def predict(self, texts: list, batch_size: int) -> torch.Tensor:
        """Logits [N, C] in the order given, float32 on the CPU whatever the device and precision.
        Texts are scored shortest first: a batch pads to its longest member, and sorting removes
        most of that padding (1.49x less evaluation compute on MiniLM, docs/performance.md);
        images keep their order, ties keep theirs."""
        was = self.training
        self.eval()
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]) if isinstance(texts[i], str) else 0)
        items = [texts[i] for i in order]
        with self.autocast():
            ce = self.class_embeddings() if self.task == "dual_encoder" else None
            out = [self(items[i:i + batch_size], ce).float().cpu() for i in range(0, len(items), batch_size)]
        self.train(was)
        if not out:
            return torch.zeros(0, len(self.class_names))
        logits = torch.cat(out)
        res = torch.empty_like(logits)
        res[torch.as_tensor(order, dtype=torch.long)] = logits
        return res

    @torch.no_grad()
    def features(self, texts: list, batch_size: int) -> torch.Tensor:
        """The input side's features E(x) [N, D] in the order given (float32, CPU): what the head
        or the cosine scorer reads, the model's summary of each input. Encoder and dual-encoder
        tasks, and instruction records (generate: the last layer's state at the prompt's last
        token); a causal LM scoring a label set has no such vector."""
        if self.task not in ("encoder_head", "dual_encoder", "generate"):
            raise ConfigError(f"model.task = {self.task!r} has no input features; this needs "
                              f"model.task = 'encoder_head', 'dual_encoder' or 'generate'")
        was = self.training
        self.eval()
        with self.autocast():
            out = [self._features(texts[i:i + batch_size]).float().cpu() for i in range(0, len(texts), batch_size)]
        self.train(was)
        return torch.cat(out) if out else torch.zeros(0, 0)

    def _features(self, texts: list) -> torch.Tensor:
        if self.task == "generate":
            return self._answering.features(texts)
        return self._inputs(texts, self._zero_shot)

    # ----------------------------------------------------------------- free-text answers (generate)
    @property
    def _lm(self) -> nn.Module:
        """The causal LM under peft's wrapper, its LoRA in place (looked up, never an attribute: a
        module attribute would register the HF model a second time)."""
        return peft.hf_model(self.backbone, self.pcfg.type)

    def encoded(self, item) -> Encoded:
        return self._answering.encoded(item)

    def response_loss(self, items: list) -> torch.Tensor:
        """The mean -log p over the batch's response tokens (prompt tokens masked)."""
        return self._answering.loss(items)

    @torch.no_grad()
    def answers(self, items: list, batch_size: int, max_new_tokens: int, stop: list[str] | None = None) -> dict:
        """Per record: the response's summed -log p and token count, the greedy answer (ended at EOS
        or before the first of `stop`), and for a multiple-choice record each option's
        log-likelihood (in eval mode, the run's precision; `fedsplice.model.answers`)."""
        was = self.training
        self.eval()
        with self.autocast():
            out = self._answering.answers(items, batch_size, max_new_tokens, stop)
        self.train(was)
        return out

    def cache_stats(self) -> dict:
        img = self._img_prefix.cache if self._img_prefix is not None else None
        prefix = self._text.prefix.cache if self._text.prefix is not None else None
        caches = (("prefix", prefix), ("features", self._inputs.features), ("vision", self._vis),
                  ("image_prefix", img), ("pixels", self._pixels))
        return {k: c.stats() for k, c in caches if c is not None}
