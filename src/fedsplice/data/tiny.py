"""Tiny random models built in-process: a WordPiece tokenizer, BERT, Llama, CLIP and a vision tower.

Each builder seeds its own forked torch RNG (the global one is untouched), builds the model from
the same Hugging Face config classes as the real checkpoints, and saves it with ``save_pretrained``
so it reloads through the same loading code. Their outputs mean nothing: they run the code paths
offline and fast. ``zoo:tiny-clip`` / ``zoo:tiny-vit`` (`fedsplice.data.zoo`) are built from here.
"""

from __future__ import annotations

from pathlib import Path

TINY_WORDS = (
    "the of and to a in is it you that he was for on are with as i his they be at one have this "
    "from or had by not but what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round man year came show every good me "
    "give our under name very through just form sentence great think say help low line differ turn "
    "cause much mean before move right boy old too same tell does set three want air well also play "
    "small end put home read hand port large spell add even land here must big high such follow act "
    "why ask men change went light kind off need house picture try us again animal point mother "
    "world near build self earth father head stand own page should country found answer school grow "
    "study still learn plant cover food sun four between state keep eye never last let thought city "
    "tree cross farm hard start might story saw far sea draw left late run while press close night "
    "real life few north open seem together next white children begin got walk example ease paper "
    "group always music those both mark often letter until mile river car feet care second book "
    "carry took science eat room friend began idea fish mountain stop once base hear horse cut sure "
    "watch color face wood main enough plain girl usual young ready above ever red list though feel "
    "talk bird soon body dog family direct pose leave song measure door product black short numeral "
    "class wind question happen complete ship area half rock order fire south problem piece told "
    "knew pass since top whole king space heard best hour better true during hundred five remember "
    "step early hold west ground interest reach fast verb sing listen six table travel less morning "
    "ten simple several toward war lay against pattern slow center love person money serve appear "
    "road map rain rule govern pull cold notice voice unit power town fine certain fly fall lead "
    "cry dark machine note wait plan figure star box noun field rest correct able pound done beauty "
    "drive stood contain front teach week final gave green oh quick develop ocean warm free minute "
    "strong special mind behind clear tail produce fact street inch multiply nothing course stay "
    "wheel full force blue object decide surface deep moon island foot system busy test record boat "
    "common gold possible plane stead dry wonder laugh thousand ago ran check game shape equate hot "
    "miss brought heat snow tire bring yes distant fill east paint language among "
    "sports art computers drugs education kids law linux medicine news pets politics songs poems "
    "startrek topic label category text about is spam ham genre fiction humor movie sad happy"
).split()
TINY_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<s>", "</s>"]
TINY_SEED = 1234


def _tiny_vocab() -> dict[str, int]:
    pieces: list[str] = list(TINY_SPECIALS)
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789")
    punct = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    pieces += chars + punct + [f"##{c}" for c in chars]
    seen = set(pieces)
    for w in TINY_WORDS:
        if w not in seen:
            seen.add(w)
            pieces.append(w)
    return {p: i for i, p in enumerate(pieces)}


def tiny_tokenizer(save_dir: Path | None = None, style: str = "bert"):
    """A small WordPiece tokenizer built in-process with ``tokenizers`` (no download).

    Lowercases and strips accents, splits on whitespace and punctuation, and falls back to single
    letters (``##x`` continuations) for words outside its ~600-word vocabulary, so any English text
    tokenizes; characters outside ascii become ``[UNK]``. ``style="bert"`` adds ``[CLS] … [SEP]``;
    ``style="llama"`` prepends ``<s>`` (like Llama's BOS). Both set ``pad_token="[PAD]"``.
    """
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from transformers import PreTrainedTokenizerFast

    if style not in ("bert", "llama", "clip"):
        raise ValueError(f"tiny_tokenizer: style must be 'bert', 'llama' or 'clip', got {style!r}")
    vocab = _tiny_vocab()
    tk = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tk.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                               strip_accents=True, lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece(prefix="##")
    if style == "bert":
        tk.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
        kwargs = dict(unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                      sep_token="[SEP]", mask_token="[MASK]")
    elif style == "llama":
        tk.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s>:1 $B:1", special_tokens=[("<s>", vocab["<s>"])])
        kwargs = dict(unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>", eos_token="</s>")
    else:  # CLIP: <s> text </s>, the text tower pools at the first </s>
        tk.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
            special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])])
        kwargs = dict(unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>", eos_token="</s>")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, model_max_length=512, **kwargs)
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(save_dir)
    return tok


def build_seeded(build, seed: int, device=None):
    """`build()` under torch seed `seed`, in a forked RNG: the global torch RNG is left untouched.

    `device` (e.g. "cuda"): tensors are created there (a large random model initializes much
    faster on a GPU); that device's RNG is forked and seeded too. None: the CPU."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        with dev:  # the CPU too: a caller's device context (a plan's meta device) never reaches the weights
            return build()


def tiny_bert(save_dir: Path, seed: int = TINY_SEED) -> Path:
    """A random 2-layer BERT (hidden 32, 4 heads) + tiny tokenizer saved to ``save_dir``."""
    from transformers import BertConfig, BertModel

    save_dir = Path(save_dir)
    tok = tiny_tokenizer(style="bert")
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=512,
                     type_vocab_size=2, pad_token_id=tok.pad_token_id)
    model = build_seeded(lambda: BertModel(cfg), seed)
    model.save_pretrained(save_dir, safe_serialization=True)
    tok.save_pretrained(save_dir)
    return save_dir


def _save(model, save_dir: Path, dtype) -> None:
    """`save_pretrained` as safetensors, cast to `dtype` first when given (bf16 halves the file)."""
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(save_dir, safe_serialization=True)


def tiny_llama(save_dir: Path, seed: int = TINY_SEED, *, shape: dict | None = None, dtype=None,
               device=None) -> Path:
    """A random 2-layer Llama causal LM with grouped-query attention like SmolLM2.

    hidden 32, 4 query heads / 2 key-value heads (head_dim 8: q/o projections 32 wide, k/v 16),
    intermediate 64, tied embeddings, init std 0.2 (so its outputs depend visibly on token order
    and position); saved with the tiny tokenizer (``style="llama"``).

    `shape` overrides ``LlamaConfig`` fields (e.g. a real model's hidden size and layer count:
    scripts/gpu_check.py); the vocabulary stays the tiny tokenizer's. `dtype` (a torch dtype)
    casts the weights before saving; `device` builds them there (`build_seeded`).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    save_dir = Path(save_dir)
    tok = tiny_tokenizer(style="llama")
    fields = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                  max_position_embeddings=512, tie_word_embeddings=True,
                  initializer_range=0.2,  # far from uniform, so tests can tell positions apart
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id)
    cfg = LlamaConfig(**{**fields, **(shape or {})})
    model = build_seeded(lambda: LlamaForCausalLM(cfg), seed, device)
    _save(model, save_dir, dtype)
    tok.save_pretrained(save_dir)
    return save_dir


def tiny_image_processor(size: int = 32):
    """CLIP's preprocessing (resize, center crop, normalize) at `size` pixels, PIL backend."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def _tiny_vision_config():
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, image_size=32, patch_size=8, projection_dim=16)


def tiny_clip(save_dir: Path, seed: int = TINY_SEED, *, text: dict | None = None, vision: dict | None = None,
              projection_dim: int = 16, dtype=None, device=None) -> Path:
    """A random CLIP: text and vision towers of 2 layers, hidden 32, 4 heads, projection 16,
    32x32 images in 8x8 patches; saved with a CLIP-style tiny tokenizer and image processor.

    `text` / `vision` override ``CLIPTextConfig`` / ``CLIPVisionConfig`` fields and
    `projection_dim` the shared projection (e.g. ViT-B/16's shape: scripts/gpu_check.py); the
    image processor follows the vision tower's ``image_size``. `dtype` casts before saving;
    `device` builds the weights there (`build_seeded`).
    """
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig

    save_dir = Path(save_dir)
    tok = tiny_tokenizer(style="clip")
    text_fields = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=77, projection_dim=projection_dim,
                       pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id)
    text_cfg = CLIPTextConfig(**{**text_fields, **(text or {})})
    vision_cfg = _tiny_vision_config()
    for k, v in {"projection_dim": projection_dim, **(vision or {})}.items():
        setattr(vision_cfg, k, v)
    cfg = CLIPConfig(text_config=text_cfg.to_dict(), vision_config=vision_cfg.to_dict(), projection_dim=projection_dim)
    model = build_seeded(lambda: CLIPModel(cfg), seed, device)
    _save(model, save_dir, dtype)
    tok.save_pretrained(save_dir)
    tiny_image_processor(vision_cfg.image_size).save_pretrained(save_dir)
    return save_dir


def tiny_vit(save_dir: Path, seed: int = TINY_SEED) -> Path:
    """A random CLIP vision tower (2 layers, hidden 32, 32x32 images: 16 patches + CLS) + processor."""
    from transformers import CLIPVisionModel

    save_dir = Path(save_dir)
    model = build_seeded(lambda: CLIPVisionModel(_tiny_vision_config()), seed)
    model.save_pretrained(save_dir, safe_serialization=True)
    tiny_image_processor().save_pretrained(save_dir)
    return save_dir
