"""The sections that say what is learned on which data: model, peft, data, scenario.

Each section is a dataclass whose `check()` validates its own fields (one-line ConfigErrors that
name the dotted field). Checks against registries outside this package — zoo model names, built-in
data set names — are `fedsplice.federation.validate`'s, so `fedsplice.config` stays a leaf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fedsplice.config.checks import ROLES, check_positive, check_roles, refuse_inert
from fedsplice.errors import ConfigError

USER_DATA_KINDS = ("csv", "jsonl", "images")
SITES = "sites"  # data.dataset: every Flower SuperNode brings its own data file (per-site data)
HF = "hf:"  # data.dataset: a Hugging Face `datasets` data set (fedsplice.data.hubdata)


def check_template(name: str, template: str, key: str, example: str) -> None:
    """`template` holds {key} and nothing else to fill in."""
    if "{" + key + "}" not in template:
        raise ConfigError(f"{name} must contain '{{{key}}}', e.g. {example!r}")
    try:
        template.format(**{key: "x"})
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"{name}: only {{{key}}} may be filled in ({type(e).__name__}: {e}); "
                          f"write a literal brace as {{{{ or }}}}") from None


def user_data(spec: str) -> tuple[str, str] | None:
    """(kind, path) of a user's data set (`csv:PATH`, `jsonl:PATH`, `images:DIR`), else None
    (a built-in data set's name, checked against the registry one layer up)."""
    kind, _, path = spec.partition(":")
    return (kind, path) if kind in USER_DATA_KINDS and path else None


@dataclass
class ModelConfig:
    name: str = "zoo:minilm"  # zoo:minilm, zoo:smollm2, a hub id or a local path
    # dual_encoder: MiniLM (text) or CLIP (images; text prompts per class); vlm: a LLaVA-style
    # vision tower (model.vision) + projector + causal LM (model.name), verbalizer scoring
    # generate: instruction tuning, free-text answers (prompt -> response records; docs/instruct.md)
    task: Literal["dual_encoder", "encoder_head", "causal_lm", "vlm", "generate"] = "dual_encoder"
    vision: str = ""  # vlm (and generate: records with images): the vision tower, zoo:tiny-vit, a hub id or a path
    projector: Literal["linear", "mlp"] = "mlp"  # vlm: vision -> LM embeddings (trainable, GLOBAL)
    input_template: str = "{text}"  # causal LM: e.g. "Text: {text}\nTopic:"
    # Dual encoder with one shared encoder (MiniLM): do the adapters also encode the class
    # prompts? False = the class side stays frozen (as CLIP-LoRA on the input tower), so class
    # embeddings are computed once and cached; True recomputes them every step.
    class_side_adapters: bool = False
    logit_scale: float = 20.0  # s in s·cos(E(x), T(c)); ~20 fits MiniLM far better than CLIP's 100
    # tokens per input (a causal LM's prompt is cut from the left: the template's end stays);
    # batches pad to their longest member only
    max_length: int = 128
    # the frozen base weights' dtype (bf16 / fp16 halve their memory); trainable tensors stay fp32
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    # QLoRA: the frozen base loaded quantized by bitsandbytes (transformers' BitsAndBytesConfig,
    # then peft's k-bit preparation); needs bitsandbytes (`fedsplice[quant]`; 0.50.2 also runs on a CPU).
    # nf4: NormalFloat with double quantization (QLoRA's); fp4: bitsandbytes' default 4-bit type,
    # without double quantization (`BitsAndBytesConfig(load_in_4bit=True)`, FlowerTune's)
    quantization: Literal["none", "int8", "nf4", "fp4"] = "none"
    gradient_checkpointing: bool = False  # HF's own switch: recompute activations in backward
    # generate: "auto" renders records with the tokenizer's chat template when it has one, else the
    # plain template (fedsplice.model.generate); "chat" requires the template, "plain" ignores it
    chat_template: Literal["auto", "chat", "plain"] = "auto"
    # generate: a named prompt template that replaces the tokenizer's chat template, so "auto" and
    # "chat" render with it (fedsplice.model.templates). "flowertune": FlowerTune's Alpaca prompt,
    # its preamble, "### Instruction:" and "### Response:" followed by " " and the answer, no end
    # token; "" keeps the tokenizer's own
    prompt_template: Literal["", "flowertune"] = ""

    def check(self) -> None:
        check_positive("model.logit_scale", self.logit_scale)
        check_positive("model.max_length", self.max_length)
        # a `zoo:NAME` is checked against the zoo by fedsplice.federation.validate
        check_template("model.input_template", self.input_template, "text", "Text: {text}\\nTopic:")
        if self.task == "vlm" and not self.vision:
            raise ConfigError("model.vision: model.task = 'vlm' needs a vision tower, e.g. "
                              "'zoo:tiny-vit', 'openai/clip-vit-base-patch32' or a local folder")
        if self.vision and self.task not in ("vlm", "generate"):
            raise ConfigError("model.vision is only used with model.task = 'vlm' or 'generate' (image tokens "
                              "before the prompt); remove it or set the task")


@dataclass
class PeftConfig:
    # "full": no PEFT, every backbone weight trains (full fine-tuning, algorithm "full-ft");
    # the LoRA fields below are then unused
    type: Literal["lora", "prompt", "adapter", "full"] = "lora"
    # LoRA (HF peft) on attention projections by role
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    roles: list[str] = field(default_factory=lambda: list(ROLES))
    layers: list[int] = field(default_factory=list)  # empty: every layer
    tower: str = ""  # CLIP-style models: "text_model" or "vision_model"; empty: the only tower
    use_rslora: bool = False  # scaling alpha/sqrt(r) instead of alpha/r
    # CoOp prompt context on the class side of a dual encoder. random: n_ctx vectors ~ N(0, 0.02²)
    # from the seeded init stream (CoOp, FedPuReL's official code; round 0 is then NOT zero-shot);
    # template: the word embeddings of data.class_prompt's words before {label} (round 0 = zero-shot)
    prompt_init: Literal["random", "template"] = "random"
    n_ctx: int = 0  # 0: 4 with random init (the FedPuReL paper's prompt length), the words' count with template
    class_specific: bool = False  # one context per class instead of one shared
    # FedCLIP feature adapter on the input embedding
    adapter_hidden: int = 0  # 0: the embedding width
    # random: torch's Linear init (FedCLIP's official code); zero: uniform attention, round 0 = zero-shot
    adapter_init: Literal["random", "zero"] = "random"

    def check(self) -> None:
        check_positive("peft.r", self.r)
        check_positive("peft.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"peft.dropout must be in [0, 1), got {self.dropout}")
        check_roles("peft.roles", self.roles)
        if not self.roles:
            raise ConfigError("peft.roles is empty; list at least one of q, k, v, o")
        if any(i < 0 for i in self.layers):
            raise ConfigError(f"peft.layers must be non-negative layer indices, got {self.layers}")
        if self.n_ctx < 0 or self.adapter_hidden < 0:
            raise ConfigError("peft.n_ctx and peft.adapter_hidden must be >= 0 (0 = automatic)")
        if self.adapter_init not in ("random", "zero"):
            raise ConfigError(f"peft.adapter_init must be 'random' or 'zero', got {self.adapter_init!r}")
        if self.prompt_init not in ("random", "template"):
            raise ConfigError(f"peft.prompt_init must be 'random' or 'template', got {self.prompt_init!r}")
        if self.type == "full" and (self.layers or self.tower or self.dropout > 0):
            # full fine-tuning trains every layer of every tower, and runs the backbone without
            # dropout as LoRA runs its frozen base: these LoRA placements would be silently ignored
            raise ConfigError("peft.layers, peft.tower and peft.dropout place LoRA; peft.type = 'full' "
                              "trains every backbone weight: remove them")


def check_user_path(field: str, kind: str, path: str) -> None:
    """A user's file (csv, jsonl) or folder (images) exists, and is what its kind says: the one
    check behind the config's and the readers' (fedsplice.data.userdata, fedsplice.data.images)."""
    p = Path(path).expanduser()
    if kind == "images":
        if p.is_file():
            other = {".csv": "csv", ".jsonl": "jsonl"}.get(p.suffix.lower())
            hint = f" (a {other.upper()} file is '{other}:{path}')" if other else ""
            raise ConfigError(f"{field}: 'images:{path}': {p} is a file, not a folder; give a folder holding one "
                              f"subfolder of images per label{hint}")
        if not p.is_dir():
            raise ConfigError(f"{field}: 'images:{path}': no such folder {p}; give a folder holding one "
                              f"subfolder of images per label")
    elif p.is_dir():
        raise ConfigError(f"{field}: '{kind}:{path}': {p} is a folder, not a {kind.upper()} file; give the "
                          f"file's path (a folder of <label>/<image> files is 'images:{path}')")
    elif not p.is_file():
        raise ConfigError(f"{field}: file {path!r} not found (no such file {p}); give the path of an existing "
                          f"{kind.upper()} file with fields `label` and `text` and/or `image`")


@dataclass
class DataConfig:
    # generate, data.partition = "dirichlet": the record field whose values the clients' shares skew over
    group_field: str = ""
    # generate: how a record's fields make the prompt and the response. "auto": the forms of
    # fedsplice.data.instruct; "flowertune-general" / "-finance" / "-medical" / "-code": FlowerTune's
    # `reformat` of that task's data set, the text kept as it is (fedsplice.data.flowertune)
    record_format: Literal["auto", "flowertune-general", "flowertune-finance", "flowertune-medical",
                           "flowertune-code"] = "auto"
    dataset: str = "fortunes"  # see `fedsplice list datasets`; or csv:PATH / jsonl:PATH / images:DIR / hf:NAME[:CONFIG]
    num_clients: int = 10
    # natural (model.task = "generate"): one client per value of the records' `client` field
    partition: Literal["dirichlet", "iid", "shards", "natural"] = "dirichlet"
    alpha: float = 0.5  # Dirichlet concentration (smaller = more label skew)
    shards_per_client: int = 2
    test_per_class: int = 20  # balanced global test set
    max_per_class: int = 0  # cap on training samples per class; 0 = no cap
    local_test_size: int = 40  # per client, drawn to match its training label distribution
    # Where the local test sets come from. "global": drawn from the global test set, so clients'
    # sets overlap each other and the global one. "disjoint": drawn from training-split items that
    # nothing else uses (not trained on, not in the global test set or the validation hold-out), no
    # item in two sets; a class whose unused items run out gets fewer (docs/data.md)
    local_test: Literal["global", "disjoint"] = "global"
    # "disjoint" only, when a class's unused items run out: "cap" cuts the clients' quotas there
    # (smaller sets, the other classes in training proportion); "refill" gives the missing items to
    # the client's other classes, so its set keeps data.local_test_size while they have items
    local_test_shortfall: Literal["cap", "refill"] = "cap"
    # "disjoint" only: the global test set is topped up to this many per class from those unused
    # items, where they last (the carve is balanced at the smallest class); 0: as carved
    global_test_per_class: int = 0
    holdout_clients: int = 0  # clients kept out of training for cold-start evaluation
    # Long tail (FedPuReL): n_c = n_max·IF^(−c/(C−1)) training samples for the c-th largest
    # class before partitioning; imbalance = 1 keeps the data as it is.
    imbalance: float = 1.0
    # which class is the c-th: "size" ranks classes by how many samples they have (largest first);
    # "permuted" by a seeded permutation unrelated to the data or the model, as long-tailed
    # benchmarks (CIFAR-100-LT, ImageNet-LT) assign ranks; the permutation is redrawn (seeded) until
    # every class holds the count its rank asks for, so the profile and the IF hold exactly.
    long_tail_order: Literal["size", "permuted"] = "size"
    n_max: int = 0  # 0: the largest class's size ("size"); the largest n_max one permutation fits ("permuted")
    # Users' image data (images:DIR, csv/jsonl with an `image` column): a file that fails to
    # decode is an error naming it; true reports each one and skips it instead.
    skip_bad_images: bool = False
    # Readable names for the labels of a user's data set, in class order: the labels sorted
    # (numerically when all are integers, else alphabetically); exactly one name per label.
    class_names: list[str] = field(default_factory=list)
    # The test split of a user's data as a second file or folder (csv:PATH, jsonl:PATH,
    # images:DIR), used as it is. Empty: a `split` column, if the file has one, else carved.
    test: str = ""
    # The class side of a dual encoder: one text per class. Empty: the data set's own template
    # (built-in sets bring one, e.g. fortunes' "a quote about {label}."; users' data "{label}.").
    class_prompt: str = ""
    # A prompt ensemble: more templates; the class embedding is the mean of the normalized
    # embeddings of class_prompt and these (CLIP's "a photo of a {label}." family)
    class_prompts: list[str] = field(default_factory=list)
    # Per-site data (dataset = "sites"): the class labels, in class order, as the sites' files
    # write them; the server never reads a site's file, so the config must name the classes.
    labels: list[str] = field(default_factory=list)
    # hf:NAME[:CONFIG] (a Hugging Face `datasets` data set, docs/data.md): its columns and splits.
    # Empty hf_text / hf_image: none of that kind; empty hf_test_split: a balanced test set carved.
    hf_text: str = "text"
    hf_image: str = ""
    hf_label: str = "label"
    hf_train_split: str = "train"
    hf_test_split: str = "test"

    def _check_hf(self) -> None:
        if not self.dataset.startswith(HF):
            refuse_inert("data", self, ("hf_text", "hf_image", "hf_label", "hf_train_split", "hf_test_split"),
                         f"data.dataset = {self.dataset!r} is no hf: data set",
                         "set data.dataset = 'hf:NAME' for it to take effect")
            return
        if not self.dataset[len(HF):].partition(":")[0]:
            raise ConfigError(f"data.dataset = {self.dataset!r}: give hf:NAME or hf:NAME:CONFIG (a hub id such as "
                              f"hf:uoft-cs/cifar100, or a local folder written by `datasets`)")
        if not (self.hf_text or self.hf_image) or not self.hf_label or not self.hf_train_split:
            raise ConfigError("data.hf_label, data.hf_train_split and data.hf_text or data.hf_image must name "
                              "the data set's label column, its training split, and its text or image column")
        if self.test:
            raise ConfigError("data.test is for users' files; an hf: data set names its test split: set "
                              "data.hf_test_split (empty: a test set is carved)")

    def _check_sites(self) -> None:
        if self.dataset != SITES:
            if self.labels:
                raise ConfigError("data.labels is for per-site data (data.dataset = 'sites'); remove it, or "
                                  "rename the classes with data.class_names")
            return
        if len(self.labels) < 2 or len(set(self.labels)) != len(self.labels):
            raise ConfigError(f"data.labels = {self.labels}: per-site data (data.dataset = 'sites') needs the "
                              f"class labels, at least 2 and each once, as the sites' files write them")
        for name, on in (("data.imbalance", self.imbalance != 1.0), ("data.n_max", self.n_max != 0)):
            if on:
                raise ConfigError(f"{name}: the long-tail cut is for one data set partitioned by seed; with "
                                  f"per-site data each site's file is used as it is; remove {name}")

    def _check_local_test(self) -> None:
        if self.local_test not in ("global", "disjoint"):
            raise ConfigError(f"data.local_test must be 'global' or 'disjoint', got {self.local_test!r}")
        if self.local_test == "disjoint" and self.dataset == SITES:
            raise ConfigError("data.local_test = 'disjoint' draws local test sets from one shared data set; per-site "
                              "data tests each site on its own file's rows: remove data.local_test")
        if self.local_test_shortfall not in ("cap", "refill"):
            raise ConfigError(f"data.local_test_shortfall must be 'cap' or 'refill', got {self.local_test_shortfall!r}")
        if self.local_test_shortfall != "cap" and self.local_test != "disjoint":
            raise ConfigError("data.local_test_shortfall is for data.local_test = 'disjoint' (sets drawn from the "
                              "global test set reuse items instead): set that, or remove data.local_test_shortfall")
        g = self.global_test_per_class
        if g < 0 or 0 < g < self.test_per_class:
            raise ConfigError(f"data.global_test_per_class must be 0 (the carved test set as it is) or at least "
                              f"data.test_per_class = {self.test_per_class}, got {g}")
        if g and self.local_test != "disjoint":
            raise ConfigError("data.global_test_per_class tops the global test set up from unused training items, "
                              "only with data.local_test = 'disjoint': set that, or remove data.global_test_per_class")
        if g and self.test:
            raise ConfigError("data.global_test_per_class: data.test is your own test split, used as it is; "
                              "remove data.global_test_per_class")

    def check(self) -> None:
        # the files of a user's data set exist; a built-in name is checked against the registry
        # by fedsplice.federation.validate
        given = user_data(self.dataset)
        if given:
            check_user_path("data.dataset", *given)
        self._check_sites()
        self._check_hf()
        tkind, tpath = user_data(self.test) or ("", "")
        if self.test and not tkind:
            raise ConfigError(f"data.test = {self.test!r}: give csv:PATH, jsonl:PATH or images:DIR (the test "
                              f"split of your data), or leave it empty")
        if tkind and self.dataset != SITES:
            check_user_path("data.test", tkind, tpath)
        if self.class_prompt:
            check_template("data.class_prompt", self.class_prompt, "label", "a quote about {label}.")
        for i, t in enumerate(self.class_prompts):
            check_template(f"data.class_prompts[{i}]", t, "label", "a photo of a {label}.")
        check_positive("data.num_clients", self.num_clients)
        check_positive("data.alpha", self.alpha)
        check_positive("data.shards_per_client", self.shards_per_client)
        check_positive("data.test_per_class", self.test_per_class)
        check_positive("data.local_test_size", self.local_test_size)
        if self.max_per_class < 0:
            raise ConfigError("data.max_per_class must be >= 0 (0 = no cap)")
        self._check_local_test()
        if self.long_tail_order not in ("size", "permuted"):
            raise ConfigError(f"data.long_tail_order must be 'size' or 'permuted', got {self.long_tail_order!r}")
        if self.imbalance < 1:
            raise ConfigError(f"data.imbalance (IF) must be >= 1 (1 = no long-tail cut), got {self.imbalance}")
        if self.n_max < 0:
            raise ConfigError("data.n_max must be >= 0 (0 = the largest class's size)")
        if not 0 <= self.holdout_clients < self.num_clients:
            raise ConfigError(f"data.holdout_clients must be in [0, data.num_clients) = "
                              f"[0, {self.num_clients}), got {self.holdout_clients}")


@dataclass
class ScenarioConfig:
    """Multimodal heterogeneity (PFAdapter §V), applied to the clients' data (train and local
    test) after partitioning, from its own seeded stream; the global test set stays aligned.

    missing modality   a share `missing_rate` (β) of the clients (`missing_level = "client"`)
                       or of every client's samples ("sample") lose the `missing` modality
                       ("either": image or text, drawn per client / per sample)
    hybrid             `aligned_share` p of the clients stay aligned; the others lose the
                       modality on a share β of their samples (needs missing_level = "sample")
    modality-dominant  `image_dominant` clients lose the text and `text_dominant` clients the
                       image on a share `dominant_rate` of their samples (I-5:T-5 = 5 and 5)
    Gaussian noise     images of a share `noise_clients` of the clients get N(0, σ²) noise,
                       σ = noise_std × 255, clipped to [0, 255]
    """

    missing_rate: float = 0.0
    missing_level: Literal["client", "sample"] = "client"
    missing: Literal["image", "text", "either"] = "either"
    aligned_share: float = 0.0
    image_dominant: int = 0
    text_dominant: int = 0
    dominant_rate: float = 0.8
    noise_std: float = 0.0
    noise_clients: float = 1.0

    def check(self) -> None:
        for name in ("missing_rate", "aligned_share", "dominant_rate", "noise_clients"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"scenario.{name} must be a share in [0, 1], got {v}")
        if self.noise_std < 0:
            raise ConfigError(f"scenario.noise_std must be >= 0 (a fraction of the pixel range), got {self.noise_std}")
        if self.image_dominant < 0 or self.text_dominant < 0:
            raise ConfigError("scenario.image_dominant and scenario.text_dominant must be >= 0 client counts")
        if self.aligned_share > 0 and self.missing_rate == 0:
            raise ConfigError("scenario.aligned_share (hybrid) needs scenario.missing_rate > 0: the share "
                              "of samples the non-aligned clients lose")
        if self.aligned_share > 0 and self.missing_level != "sample":
            raise ConfigError("scenario.aligned_share (hybrid) needs scenario.missing_level = 'sample': "
                              "the non-aligned clients lose the modality on a share missing_rate of their samples")
        if self.missing_rate > 0 and (self.image_dominant or self.text_dominant):
            raise ConfigError("scenario: choose missing modality (missing_rate) or modality-dominant clients "
                              "(image_dominant / text_dominant), not both")

    def active(self) -> bool:
        return bool(self.missing_rate or self.image_dominant or self.text_dominant or self.noise_std)
