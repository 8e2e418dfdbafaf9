"""PEFT types besides LoRA (which comes from HF peft): CoOp prompts and a FedCLIP feature adapter.

Both start random by default, as the official codes do, so round 0 is not zero-shot: the adapter
with torch's Linear init, the prompt context ~ N(0, 0.02²) (CoOp). peft.prompt_init = "template"
starts the context from the class prompt's own words, and peft.adapter_init = "zero" starts the
adapter's attention uniform; either makes round 0 equal zero-shot exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedsplice.errors import ConfigError


class PromptLearner(nn.Module):
    """CoOp (Zhou et al. 2022): learnable context vectors replacing the words of the class prompt
    before "{label}" — "a quote about {label}." becomes [CLS] v_1..v_n label . [SEP].

    init "random" draws n_ctx vectors v ~ N(0, 0.02²) from a seeded generator (n_ctx 0: 4);
    "template" initializes v from the words before {label} (n_ctx 0 or their count: an exact
    zero-shot start). class_specific gives each class its own context (C × n × d), else one
    shared context (n × d).
    """

    # buffers (register_buffer): declared so they type as tensors, not nn.Module's Tensor | Module
    cls_id: torch.Tensor
    tail_ids: torch.Tensor
    mask: torch.Tensor

    def __init__(self, tokenizer, word_embeddings: nn.Embedding, template: str, class_names: list[str],
                 n_ctx: int, class_specific: bool, generator: torch.Generator, init: str = "random"):
        super().__init__()
        prefix, suffix = template.split("{label}", 1)
        emb = word_embeddings.weight
        prefix_ids = tokenizer(prefix.strip(), add_special_tokens=False)["input_ids"]
        if init == "template" and not prefix_ids:
            raise ConfigError(f"peft.prompt_init = 'template' starts the context from the words of the class "
                              f"prompt before {{label}}, and {template!r} has none; set peft.prompt_init = "
                              f"'random' or a data.class_prompt with words before {{label}}")
        if init == "template" and n_ctx not in (0, len(prefix_ids)):
            raise ConfigError(f"peft.n_ctx = {n_ctx}: peft.prompt_init = 'template' takes one context vector per "
                              f"token of {prefix.strip()!r} ({len(prefix_ids)}); set peft.n_ctx = 0")
        if init == "template":
            ctx = emb[prefix_ids].detach().float().clone()  # an fp32 master, whatever model.dtype
        else:
            ctx = torch.randn(n_ctx or 4, emb.shape[1], generator=generator) * 0.02
        if class_specific:
            ctx = ctx.unsqueeze(0).repeat(len(class_names), 1, 1)
        self.ctx = nn.Parameter(ctx)
        self.n_ctx = ctx.shape[-2]
        # Frozen pieces of each class sequence: [CLS] (ctx) label+suffix tokens [SEP].
        cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
        sep_id = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
        rows = [tokenizer(f"{c}{suffix}".strip(), add_special_tokens=False)["input_ids"] for c in class_names]
        longest = max(len(r) for r in rows)
        pad = tokenizer.pad_token_id or 0
        ids = torch.full((len(rows), longest + 1), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), 2 + self.n_ctx + longest, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r) + 1] = torch.tensor(r + [sep_id])
            mask[i, :2 + self.n_ctx + len(r)] = 1
        self.register_buffer("cls_id", torch.tensor([cls_id]), persistent=False)
        self.register_buffer("tail_ids", ids, persistent=False)
        self.register_buffer("mask", mask, persistent=False)

    def inputs(self, word_embeddings: nn.Embedding,
               ctx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_embeds [C, L, d], attention_mask [C, L]) for the C class sequences, around `ctx`
        ([n_ctx, d] or [C, n_ctx, d]) in place of the learner's own context (None: its own)."""
        c = self.tail_ids.shape[0]
        head = word_embeddings(self.cls_id).expand(c, 1, -1)
        ctx = self.ctx if ctx is None else ctx
        ctx = ctx if ctx.dim() == 3 else ctx.unsqueeze(0).expand(c, -1, -1)
        return torch.cat([head, ctx, word_embeddings(self.tail_ids)], dim=1), self.mask


class FeatureAdapter(nn.Module):
    """FedCLIP's attention adapter (Lu et al. 2023; its official code): f' = softmax(W2·tanh(W1·f)) ⊙ f.

    init "random": every weight and bias ~ U(±1/√fan_in), torch's Linear default, as the official
    code leaves them (seeded here). init "zero" (our switch): W2 and both biases start at zero,
    so the attention is uniform, f' ∝ f, and after normalization round 0 is zero-shot exactly.
    """

    def __init__(self, dim: int, hidden: int, generator: torch.Generator, init: str = "random"):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        with torch.no_grad():
            for layer, fan_in in ((self.fc1, dim), (self.fc2, hidden)):
                b = 1.0 / fan_in**0.5
                layer.weight.copy_(torch.empty(layer.weight.shape).uniform_(-b, b, generator=generator))
                layer.bias.copy_(torch.empty(layer.bias.shape).uniform_(-b, b, generator=generator))
            if init == "zero":
                self.fc1.bias.zero_()
                self.fc2.weight.zero_()
                self.fc2.bias.zero_()

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        att = F.softmax(self.fc2(torch.tanh(self.fc1(f))), dim=-1)
        return att * f * f.shape[-1]  # × d keeps the scale of f at the uniform start
