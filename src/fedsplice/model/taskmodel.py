"""Backbones: a frozen Hugging Face model, LoRA by role (through HF peft), and a task head.

Roles name attention projections across architectures (q, k, v, o), so a split written in
roles fits every backbone. Four tasks score a batch of inputs (texts, or `Sample`s holding an
image and/or a text) into class logits [B, C]:
  dual_encoder  s·cos(E(x), T(prompt(c)))  — zero-shot before any training (MiniLM; CLIP, whose
                E is the image tower and T the text tower: fedsplice.model.vision)
  encoder_head  Linear(meanpool(E(x)))      — a trainable head (FedPer keeps it private)
  causal_lm     Σ log p(answer_c | prompt(x)) — verbalizer scoring (SmolLM2, Llama)
  vlm           the same with projected image tokens before the prompt (LLaVA-style); LoRA
                roles refer to the LM's attention
"""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from fedsplice.model.adapters import FeatureAdapter, PromptLearner
from fedsplice.model.cache import FrozenCache, TokenCache, fingerprint
from fedsplice.config import ExperimentConfig
from fedsplice.errors import ConfigError
from fedsplice.data.samples import Sample
from fedsplice.core.split import ParamInfo

_BERT = {"q": "attention.self.query", "k": "attention.self.key",
         "v": "attention.self.value", "o": "attention.output.dense"}
_LLAMA = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj"}
_CLIP = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.out_proj"}
ROLE_MAPS = {
    "bert": _BERT, "roberta": _BERT, "xlm-roberta": _BERT, "electra": _BERT,
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA,
    "clip": _CLIP, "clip_text_model": _CLIP, "clip_vision_model": _CLIP, "siglip": _CLIP,
}
_LAYER = re.compile(r"^(.*?\.(?:layer|layers|h)\.\d+)\.")
# (embeddings, layer stack) of the encoders whose frozen prefix can be cached: BERT-like and the
# CLIP text tower, where the embeddings feed layer 0 directly (CLIP's vision tower has a
# pre-layernorm in between, so it is not listed). Others run the full forward.
_STACKS = (("embeddings", "encoder.layer"), ("text_model.embeddings", "text_model.encoder.layers"))


class _Const(nn.Module):
    """Stands in for the embeddings: returns the cached hidden states of the frozen prefix."""

    def __init__(self, h: torch.Tensor):
        super().__init__()
        self.h = h

    def forward(self, *args, **kwargs):
        return self.h


def role_map(model_type: str) -> dict[str, str]:
    if model_type not in ROLE_MAPS:
        raise ConfigError(f"model.name: no q/k/v/o role map for model_type {model_type!r}; "
                          f"supported: {', '.join(sorted(ROLE_MAPS))}")
    return ROLE_MAPS[model_type]


def target_regex(rmap: dict[str, str], roles, layers, tower: str) -> str:
    """A peft target_modules regex (full match on module names) for roles × layers × tower."""
    idx = "|".join(str(i) for i in layers) if layers else r"\d+"
    suffix = "|".join(re.escape(rmap[r]) for r in roles)
    prefix = rf"(?:.*\.)?{re.escape(tower)}\..*" if tower else ".*"
    return rf"{prefix}\.(?:layer|layers|h)\.(?:{idx})\.(?:{suffix})"


def _load(cfg: ExperimentConfig):
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    from fedsplice.data.zoo import resolve_model

    path = resolve_model(cfg.model.name)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        cls = AutoModelForCausalLM if cfg.model.task in ("causal_lm", "vlm") else AutoModel
        model = cls.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.name: cannot load {cfg.model.name!r} ({str(e).splitlines()[0]}); "
                          f"use zoo:minilm, zoo:smollm2, a local folder or a hub id") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok, path


class TaskModel(nn.Module):
    def __init__(self, cfg: ExperimentConfig, class_names: list[str]):
        super().__init__()
        self.task = cfg.model.task
        self.mcfg = cfg.model
        self.pcfg = cfg.peft
        self.class_names = list(class_names)
        base, self.tokenizer, path = _load(cfg)
        for p in base.parameters():
            p.requires_grad_(False)
        mtype = getattr(base.config, "model_type", "?")
        self.rmap = role_map(mtype)
        pc = cfg.peft
        # CLIP: images on the input side (E), class prompts through the text tower (T)
        self.is_clip = mtype == "clip"
        self.image_processor = self.vision = self.projector = self._clip_inputs = None
        if self.is_clip:
            from fedsplice.model.vision import load_image_processor

            self.image_processor = load_image_processor(path, "model.name")
        if pc.type in ("prompt", "adapter") and self.task in ("causal_lm", "vlm"):
            raise ConfigError(f"peft.type = {pc.type!r} needs a dual encoder or encoder + head; "
                              f"use peft.type = 'lora' with model.task = {self.task!r}")
        if pc.type == "prompt" and self.task != "dual_encoder":
            raise ConfigError("peft.type = 'prompt' learns the class prompts of a dual encoder: "
                              "set model.task = 'dual_encoder'")
        hidden = base.config.projection_dim if self.is_clip else base.config.hidden_size
        # Every random init draws from generators seeded by cfg.seed, never the global stream.
        gen = torch.Generator().manual_seed(cfg.seed)
        self.prompt = self.prompt_local = self.adapter = None
        if pc.type == "lora":
            self.backbone = self._inject_lora(base, pc, cfg.seed, mtype)
        else:
            self.backbone = base
        if pc.type == "prompt":
            we = base.text_model.embeddings.token_embedding if self.is_clip else base.get_input_embeddings()
            mk = lambda: PromptLearner(self.tokenizer, we, self.mcfg.class_prompt, self.class_names,  # noqa: E731
                                       pc.n_ctx, pc.class_specific, gen)
            self.prompt = mk()
            self.prompt_local = mk() if pc.portfolio > 0 else None
            limit = base.config.text_config.max_position_embeddings if self.is_clip else None
            if limit and self.prompt.mask.shape[1] > limit:
                raise ConfigError(f"peft.n_ctx: the longest class sequence has {self.prompt.mask.shape[1]} "
                                  f"tokens, CLIP's text tower takes {limit}; lower peft.n_ctx or shorten "
                                  f"model.class_prompt / the class names")
        if pc.type == "adapter":
            self.adapter = FeatureAdapter(hidden, pc.adapter_hidden or hidden, gen)
        self.head = None
        if self.task == "encoder_head":
            self.head = nn.Linear(hidden, len(class_names))
            with torch.no_grad():
                bound = 1.0 / hidden**0.5
                self.head.weight.copy_(torch.empty_like(self.head.weight).uniform_(-bound, bound, generator=gen))
                self.head.bias.zero_()
        if pc.type == "lora":
            self._check_roles(pc.roles, mtype)
        if self.task == "vlm":
            from fedsplice.model.vision import Projector, load_vision_tower

            self.vision, self.image_processor, vh = load_vision_tower(cfg.model.vision)
            pgen = torch.Generator().manual_seed(cfg.seed + 7919)  # its own stream: text inits unchanged
            self.projector = Projector(vh, hidden, cfg.model.projector, pgen)
        # CLIP with LoRA in its text tower: the class side changes as it trains
        self._class_side = cfg.model.class_side_adapters or (
            self.is_clip and pc.type == "lora" and pc.tower != "vision_model")
        self._frozen_class_emb: torch.Tensor | None = None
        self._zero_shot = False
        rc = cfg.runtime
        self.cache_on = rc.cache
        max_len = self.mcfg.max_length
        if self.is_clip:  # CLIP's text tower has a fixed number of positions (77)
            max_len = min(max_len, base.config.text_config.max_position_embeddings)
        self._tok = TokenCache(self.tokenizer, max_len, rc.cache)
        # prompt/adapter: the input side is frozen whole, so its pooled features are cached
        frozen_inputs = rc.cache and pc.type in ("prompt", "adapter") and self.task not in ("causal_lm", "vlm")
        self._features = FrozenCache({"kind": "features"}, 1 << 62) if frozen_inputs else None
        # vlm: the frozen vision tower's tokens, per image (keyed by its pixels: vision.image_key)
        self._vis = (FrozenCache({"kind": "vision"}, rc.cache_budget_mb << 20)
                     if rc.cache and self.task == "vlm" else None)
        self._prefix, self._l0, self._paths = None, 0, None
        if (rc.cache and pc.type == "lora" and pc.layers and min(pc.layers) > 0
                and self.task not in ("causal_lm", "vlm") and not self.is_clip):
            self._init_prefix_cache(cfg, min(pc.layers))
        self._img_prefix = None
        if self.is_clip and rc.cache and pc.type == "lora" and (pc.tower == "text_model" or (
                pc.layers and min(pc.layers) > 0)):
            self._init_image_prefix(cfg, base)

    def _inject_lora(self, base, pc, seed: int, mtype: str):
        from peft import LoraConfig, get_peft_model

        regex = target_regex(self.rmap, pc.roles, pc.layers, pc.tower)
        lcfg = LoraConfig(r=pc.r, lora_alpha=pc.alpha, lora_dropout=pc.dropout, target_modules=regex,
                          use_rslora=pc.use_rslora, bias="none")
        # LoRA A init draws from torch's RNG: seed it locally so the global stream is untouched.
        with torch.random.fork_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft probing deprecated HF helpers
            torch.manual_seed(seed)
            try:
                return get_peft_model(base, lcfg)
            except ValueError as e:
                raise ConfigError(f"peft: no module of this {mtype} backbone matches roles {pc.roles}, "
                                  f"layers {pc.layers or 'all'}, tower {pc.tower or '(any)'} ({e}); "
                                  f"check peft.layers / peft.tower") from None

    def train(self, mode: bool = True):
        """The frozen backbone always runs as at inference (no dropout): its work is then a pure
        function of the input, which makes caching it exact (DESIGN §7). The adapters' own
        dropout (peft.dropout) and the trainable modules follow `mode`."""
        super().train(mode)
        self.backbone.eval()
        if self.vision is not None:
            self.vision.eval()
        for name, mod in self.backbone.named_modules():
            if "lora_dropout" in name:
                mod.train(mode)
        return self

    def _hf(self):
        return self.backbone.get_base_model() if self.pcfg.type == "lora" else self.backbone

    def _init_prefix_cache(self, cfg: ExperimentConfig, l0: int) -> None:
        """Hidden states entering layer l0 (the first adapted one) depend on frozen weights only."""
        hf = self._hf()
        for emb, layers in _STACKS:
            try:
                frozen = [hf.get_submodule(emb)] + list(hf.get_submodule(layers))[:l0]
            except AttributeError:
                continue
            ns = {"kind": "prefix", "model": cfg.model.name, "first_adapted_layer": l0,
                  "max_length": self.mcfg.max_length, "tokenizer": self.tokenizer.name_or_path,
                  "weights": fingerprint(p for m in frozen for p in m.parameters())}
            self._prefix = FrozenCache(ns, cfg.runtime.cache_budget_mb << 20, cfg.runtime.cache_dir)
            self._l0, self._paths = l0, (emb, layers)
            return

    def _init_image_prefix(self, cfg: ExperimentConfig, base) -> None:
        """CLIP: cache the frozen bottom of the vision tower (vision.ClipImagePrefix)."""
        from fedsplice.model.vision import ClipImagePrefix

        vm = base.vision_model
        layers = list(vm.encoder.layers)
        l0 = len(layers) if cfg.peft.tower == "text_model" else min(cfg.peft.layers)
        frozen = [vm.embeddings, vm.pre_layrnorm, *layers[:l0]]
        ns = {"kind": "clip-image-prefix", "model": cfg.model.name, "first_adapted_layer": l0,
              "weights": fingerprint(p for m in frozen for p in m.parameters())}
        cache = FrozenCache(ns, cfg.runtime.cache_budget_mb << 20, cfg.runtime.cache_dir)
        self._img_prefix = ClipImagePrefix(base, self.image_processor, l0, cache)

    @contextmanager
    def _swapped(self, path: str, new: nn.Module):
        parent_path, _, attr = path.rpartition(".")
        parent = self._hf().get_submodule(parent_path) if parent_path else self._hf()
        old = getattr(parent, attr)
        setattr(parent, attr, new)
        try:
            yield
        finally:
            setattr(parent, attr, old)

    def _prefix_states(self, texts: list[str], enc) -> torch.Tensor:
        """[B, T, H] hidden states entering layer l0, from the cache or computed (and kept)."""
        emb, layers_path = self._paths

        def compute(missing: list[str]) -> list[torch.Tensor]:
            sub = self._tok(missing)
            layers = list(self._hf().get_submodule(layers_path))
            got = {}
            hook = layers[self._l0 - 1].register_forward_hook(
                lambda m, a, o: got.__setitem__("h", o[0] if isinstance(o, tuple) else o))
            try:  # run the frozen prefix only: the stack cut after layer l0 - 1
                with torch.no_grad(), self._swapped(layers_path, nn.ModuleList(layers[:self._l0])):
                    self.backbone(**sub)
            finally:
                hook.remove()
            sm = sub["attention_mask"].bool()
            return [got["h"][j][sm[j]] for j in range(len(missing))]  # unpadded

        rows = self._prefix.rows(texts, compute)
        mask = enc["attention_mask"].bool()
        h = torch.zeros(*mask.shape, rows[0].shape[-1])
        for i, r in enumerate(rows):
            h[i][mask[i]] = r
        return h

    def _encode(self, enc, texts: list[str]) -> torch.Tensor:
        if self._prefix is None:
            return self.backbone(**enc).last_hidden_state
        emb, layers_path = self._paths
        h = self._prefix_states(texts, enc)
        upper = nn.ModuleList(list(self._hf().get_submodule(layers_path))[self._l0:])
        with self._swapped(emb, _Const(h)), self._swapped(layers_path, upper):
            return self.backbone(**enc).last_hidden_state

    def cache_stats(self) -> dict:
        img = self._img_prefix.cache if self._img_prefix is not None else None
        caches = (("prefix", self._prefix), ("features", self._features), ("vision", self._vis), ("image_prefix", img))
        return {k: c.stats() for k, c in caches if c is not None}

    @contextmanager
    def zero_shot(self):
        """Score with the frozen model alone: no LoRA, no adapter, the template class prompts."""
        self._zero_shot = True
        try:
            with (self.backbone.disable_adapter() if self.pcfg.type == "lora" else nullcontext()):
                yield self
        finally:
            self._zero_shot = False

    # ----------------------------------------------------------------- parameters by name
    def trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def param_infos(self) -> dict[str, ParamInfo]:
        infos = {}
        for name in self.trainable():
            if ".lora_A." in name or ".lora_B." in name:
                factor = "A" if ".lora_A." in name else "B"
                module = name.split(f".lora_{factor}.")[0]
                role = next((r for r, s in self.rmap.items() if module.endswith("." + s)), None)
                m = _LAYER.match(module)
                infos[name] = ParamInfo(role, factor, m.group(1) if m else module, "lora")
            else:  # head, prompt, prompt_local, adapter, projector: named by their module
                infos[name] = ParamInfo(None, None, None, name.split(".")[0])
        return infos

    def scalings(self) -> dict[str, float]:
        """LoRA scaling s (alpha/r, or alpha/sqrt(r) with rsLoRA) for each LoRA tensor name."""
        out = {}
        for mname, mod in self.named_modules():
            if hasattr(mod, "scaling") and isinstance(mod.scaling, dict) and "default" in mod.scaling:
                for f in ("A", "B"):
                    out[f"{mname}.lora_{f}.default.weight"] = float(mod.scaling["default"])
        return out

    def _check_roles(self, roles, mtype) -> None:
        found = {i.role for i in self.param_infos().values() if i.kind == "lora"}
        missing = [r for r in roles if r not in found]
        if missing:
            raise ConfigError(f"peft.roles: role(s) {missing} match no module of this {mtype} backbone "
                              f"(role map {self.rmap}); choose roles it has or another model")

    @torch.no_grad()
    def load_params(self, tensors: dict[str, torch.Tensor]) -> None:
        params = dict(self.named_parameters())
        for n, t in tensors.items():
            if params[n].shape != t.shape:
                hint = (" (model.vision: a projector built for another vision tower's hidden size)"
                        if n.startswith("projector.") else "")
                raise ConfigError(f"{n}: tensor of shape {tuple(t.shape)} does not fit the model's "
                                  f"{tuple(params[n].shape)}{hint}; load it into the model it came from")
            params[n].copy_(t)

    # ----------------------------------------------------------------- scoring
    def _embed(self, texts: list[str]) -> torch.Tensor:
        enc = self._tok(texts)
        out = self._encode(enc, texts)
        mask = enc["attention_mask"].unsqueeze(-1).to(out.dtype)
        return (out * mask).sum(1) / mask.sum(1).clamp_min(1.0)  # mean pooling (sentence-transformers)

    def _embed_text(self, texts: list[str]) -> torch.Tensor:
        """T(texts): CLIP's projected text features, else mean-pooled hidden states."""
        if self.is_clip:
            return self._hf().get_text_features(**self._tok(list(texts))).pooler_output
        return self._embed(texts)

    def _class_text(self) -> torch.Tensor:
        """Normalized class embeddings; a prompt ensemble averages its templates' (CLIP)."""
        es = [F.normalize(self._embed_text(self._prompts(t)), dim=-1) for t in self._templates()]
        return es[0] if len(es) == 1 else F.normalize(torch.stack(es).mean(0), dim=-1)

    def _frozen_class_embeddings(self) -> torch.Tensor:
        if self._frozen_class_emb is None or not self.cache_on:  # frozen work, computed once
            with torch.no_grad(), (self.backbone.disable_adapter() if self.pcfg.type == "lora" else nullcontext()):
                self._frozen_class_emb = self._class_text()
        return self._frozen_class_emb

    def _word_embeddings(self) -> nn.Embedding:
        return self._hf().text_model.embeddings.token_embedding if self.is_clip else self.backbone.get_input_embeddings()

    def _prompt_embeddings(self, learner: PromptLearner) -> torch.Tensor:
        embeds, mask = learner.inputs(self._word_embeddings())
        if self.is_clip:
            from fedsplice.model.vision import clip_text_from_embeds

            return F.normalize(clip_text_from_embeds(self._hf(), embeds, mask), dim=-1)
        out = self.backbone(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(out.dtype)
        return F.normalize((out * m).sum(1) / m.sum(1), dim=-1)

    def class_embeddings(self) -> torch.Tensor:
        if self._zero_shot or self.pcfg.type == "adapter":
            return self._frozen_class_embeddings()
        if self.pcfg.type == "prompt":
            e = self._prompt_embeddings(self.prompt)
            if self.prompt_local is not None:  # PromptFolio: a portfolio of global and local features
                th = self.pcfg.portfolio
                e = F.normalize((1 - th) * e + th * self._prompt_embeddings(self.prompt_local), dim=-1)
            return e
        if not self._class_side:
            return self._frozen_class_embeddings()
        return self._class_text()

    def _templates(self) -> list[str]:
        return [self.mcfg.class_prompt, *self.mcfg.class_prompts]

    def _prompts(self, template: str | None = None) -> list[str]:
        return [(template or self.mcfg.class_prompt).format(label=c) for c in self.class_names]

    def _embed_inputs(self, items: list) -> torch.Tensor:
        """E(x): text encoder for texts; CLIP's image (and caption) features for samples."""
        if not self.is_clip:
            if any(isinstance(s, Sample) for s in items):
                raise ConfigError("data.dataset holds images but model.name is a text encoder; use a CLIP "
                                  "checkpoint (dual_encoder) or model.task = 'vlm'")
            return self._embed(items)
        if self._clip_inputs is None:
            from fedsplice.model.vision import ClipInputs

            text = self._embed_text
            if self.cache_on and not self._class_side:  # frozen text tower: captions encoded once
                captions = FrozenCache({"kind": "clip-captions"}, 1 << 62)
                text = lambda ts: torch.stack(captions.rows(ts, self._embed_text))  # noqa: E731
            self._clip_inputs = ClipInputs(self._hf(), self.image_processor, text, self._img_prefix)
        return self._clip_inputs(items)

    def _input_features(self, texts: list[str]) -> torch.Tensor:
        if self.pcfg.type == "lora":
            return self._embed_inputs(texts)
        with torch.no_grad():  # the encoder is frozen on the input side for prompts and adapters
            f = self._frozen_features(texts)
        return f if (self.adapter is None or self._zero_shot) else self.adapter(f)

    def _frozen_features(self, texts: list[str]) -> torch.Tensor:
        if self._features is None:
            return self._embed_inputs(texts)
        return torch.stack(self._features.rows(texts, self._embed_inputs))

    def forward(self, texts: list[str], class_emb: torch.Tensor | None = None) -> torch.Tensor:
        if self.task == "dual_encoder":
            # With class-side adapters the class embeddings change every step while training;
            # evaluation passes them in once per model.
            ce = self.class_embeddings() if class_emb is None else class_emb
            return self.mcfg.logit_scale * F.normalize(self._input_features(texts), dim=-1) @ ce.T
        if self.task == "encoder_head":
            return self.head(self._input_features(texts))
        from fedsplice.model.verbalizer import verbalizer_logits

        if self.task == "vlm":
            return verbalizer_logits(self.backbone, self.tokenizer, self._lm_prompts(texts),
                                     [" " + c for c in self.class_names], prefix=self._image_tokens(texts))
        if any(isinstance(s, Sample) and s.has_image for s in texts):
            raise ConfigError("data.dataset holds images but model.task = 'causal_lm' reads text only; "
                              "set model.task = 'vlm' and model.vision")
        return verbalizer_logits(self.backbone, self.tokenizer, self._lm_prompts(texts),
                                 [" " + c for c in self.class_names])

    def _lm_prompts(self, items: list) -> list[str]:
        """The prompt of each input: a sample's text (never its key), "" when it has none."""
        text = [(s.text if isinstance(s, Sample) else s) for s in items]
        return [self.mcfg.input_template.format(text=t if t is not None else "") for t in text]

    def _image_tokens(self, items: list) -> list[torch.Tensor | None]:
        """Projected image tokens per sample (None without an image); the tower's work is cached."""
        from fedsplice.model.vision import image_key, vision_tokens

        has = [i for i, s in enumerate(items) if isinstance(s, Sample) and s.has_image]
        out: list[torch.Tensor | None] = [None] * len(items)
        if not has:
            return out
        imgs = [items[i] for i in has]
        if self._vis is None:
            feats = vision_tokens(self.vision, self.image_processor, imgs)
        else:  # keyed by the pixels: easy-VQA asks ~10 questions per image, |notext copies share it
            by_key = {image_key(s): s for s in imgs}
            feats = self._vis.rows([image_key(s) for s in imgs],
                                   lambda ks: vision_tokens(self.vision, self.image_processor, [by_key[k] for k in ks]))
        projected = self.projector(torch.stack(feats))  # one call: a tower gives every image T tokens
        for i, f in zip(has, projected):
            out[i] = f
        return out

    @torch.no_grad()
    def predict(self, texts: list[str], batch_size: int) -> torch.Tensor:
        was = self.training
        self.eval()
        ce = self.class_embeddings() if self.task == "dual_encoder" else None
        out = [self(texts[i:i + batch_size], ce) for i in range(0, len(texts), batch_size)]
        self.train(was)
        return torch.cat(out) if out else torch.zeros(0, len(self.class_names))
