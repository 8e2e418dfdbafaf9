"""Generated answers and instruction training, tokens a second (issue 48).

    python benchmarks/generate.py [--quick] [--records N] [--tokens T] [--threads K]

On configs/pfadapter-instruct-smollm2.toml's model and data (SmolLM2-135M-Instruct, WordNet
definitions; --quick: the tiny Llama on records made here), the first N global test records'
prompts (16; --quick 8), rendered by the model's template, one process, one after another:
  plain generate loop   `model.generate` on one prompt at a time (greedy, at most T new tokens,
                        stopped at EOS): what a loop over clients' prompts does without batching
  fedsplice greedy      `fedsplice.model.generate.greedy`: the same prompts batched shortest first
                        (16 a batch, left-padded) through the KV cache
  training step         the response loss's forward and backward (`TaskModel.response_loss`) on
                        batches of 16 training records, padded and unpadded (runtime.unpad):
                        tokens a second, all and response tokens
`same answers` counts the prompts whose batched answer equals the plain loop's, text for text.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import FP32, ROOT, quick_sets, report  # noqa: E402

CONFIG = ROOT / "configs" / "pfadapter-instruct-smollm2.toml"
T = TypeVar("T")


def quick_records(folder: Path) -> Path:
    """48 prompt -> response records in the tiny tokenizer's words (a stand-in for WordNet's)."""
    words = "tree sea bird fire road city king song star dog water house".split()
    rows = [{"prompt": f"Define the noun \"{words[i % 12]} {words[(i * 5) % 12]} {i}\".",
             "response": f"a {words[(i * 7) % 12]} of the {words[(i * 3) % 12]}", "pos": "noun"} for i in range(48)]
    path = folder / "records.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def build_exp(quick: bool, threads: int, folder: Path):
    from fedsplice.federation import build
    from fedsplice.federation.validate import load_config

    sets = [*FP32, f"runtime.threads={threads}"]
    if quick:
        sets += quick_sets(CONFIG, folder, budget=False)
        sets += [f"data.dataset='jsonl:{quick_records(folder)}'", "data.test_per_class=8", "data.max_per_class=0",
                 "data.partition=iid", "data.group_field=''"]
    return build(load_config(CONFIG, sets))


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def train_rows(m, recs: list) -> list[dict]:
    """The training step on `recs` in batches of 16, padded to each batch's longest record and
    unpadded (runtime.unpad's sub-batches of similar length), interleaved twice, the faster of each."""
    from fedsplice.model.unpad import CPU_OVERHEAD

    m.train()
    enc = [m.encoded(x) for x in recs]  # encoded once before any timing
    batches = [recs[i:i + 16] for i in range(0, len(recs), 16)]

    def steps(overhead: int | None) -> None:
        m._answering.overhead = overhead
        for b in batches:
            m.zero_grad(set_to_none=True)
            m.response_loss(b).backward()

    best: dict[str, float] = {}
    for _ in range(2):
        for name, overhead in (("padded", None), ("unpadded", CPU_OVERHEAD)):
            t0 = time.perf_counter()
            steps(overhead)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    tokens, resp = sum(map(len, enc)), sum(len(e.response) for e in enc)
    return [{"row": f"training step (response loss, batch 16, {name})", "records": len(recs), "tokens": tokens,
             "seconds": t, "tokens/s": tokens / t, "speed-up": best["padded"] / t,
             "same answers": f"{resp / t:.1f} response tokens/s"} for name, t in best.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--records", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    from fedsplice.model.generate import greedy
    from fedsplice.model.verbalizer import pad_id

    n = args.records or (8 if args.quick else 16)
    with tempfile.TemporaryDirectory() as tmp:
        exp = build_exp(args.quick, args.threads, Path(tmp))
        m, tok = exp.model, exp.model.tokenizer
        m.eval()
        prompts = [m.encoded(x).prompt for x in exp.data.test_texts[:n]]
        lm, pad = m._lm, pad_id(tok)
        ends = [i for i in {tok.eos_token_id, *([lm.generation_config.eos_token_id] if isinstance(
            lm.generation_config.eos_token_id, int) else lm.generation_config.eos_token_id or [])} if i is not None]

        def plain() -> list[list[int]]:
            with torch.no_grad():
                return [lm.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=args.tokens, do_sample=False, eos_token_id=ends,
                                    pad_token_id=pad)[0, len(p):].tolist() for p in prompts]

        t_plain, ids = timed(plain)
        texts = [tok.decode(i, skip_special_tokens=True).strip() for i in ids]
        gen = sum(len([t for t in i if t != pad]) for i in ids)
        t_ours, ours = timed(lambda: greedy(lm, tok, prompts, max_new_tokens=args.tokens, batch_size=16, pad_id=pad))
        same = sum(a == b for a, b in zip(texts, ours))
        train = train_rows(m, exp.data.train_texts[:16 * 3])
    rows = [{"row": "plain generate loop", "records": n, "tokens": gen, "seconds": t_plain, "tokens/s": gen / t_plain,
             "speed-up": 1.0, "same answers": f"{n}/{n}"},
            {"row": "fedsplice greedy (batched, KV cache)", "records": n, "tokens": gen, "seconds": t_ours,
             "tokens/s": gen / t_ours, "speed-up": t_plain / t_ours, "same answers": f"{same}/{n}"},
            *train]
    report("generate", rows, ["row", "records", "tokens", "seconds", "tokens/s", "speed-up", "same answers"],
           args.quick, [f"model {exp.cfg.model.name}, {args.threads} torch thread(s), fp32, at most {args.tokens} new "
                        f"tokens; tokens in the generation rows: the plain loop's generated tokens"])


if __name__ == "__main__":
    main()
