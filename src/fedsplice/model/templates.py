"""Named prompt templates, installed as a tokenizer's chat template (model.prompt_template).

Installed there, a template renders through the same path as any chat template
(fedsplice.model.generate: the prompt with the generation prompt, the answer as what the
assistant turn adds), so training, generation and export all see it; an exported tokenizer keeps it.

"flowertune": the prompt of FlowerTune's apps (flwrlabs/flower, examples/flowertune-llm-*/*/dataset.py,
`formatting_prompts_func`), Stanford Alpaca's preamble without the blank lines:

    <the tokenizer's own leading special tokens, e.g. BOS>Below is an instruction that describes a
    task. Write a response that appropriately completes the request.\\n### Instruction:\\n{instruction}
    \\n### Response: {response}

Their trainer (trl's SFTTrainer) tokenizes that text with the tokenizer's special tokens, so a BOS
where the tokenizer adds one and no end token: the padding is the EOS and is masked out of the
labels, so no EOS is ever learned. Their collator (DataCollatorForCompletionOnlyLM on
"\\n### Response:") puts the loss on everything after the marker: here the answer's tokens, " "
and the response. One user turn only: a system turn or earlier turns are refused where the data
is read (fedsplice.data.flowertune.check_single_turn).
"""

from __future__ import annotations

import json

from fedsplice.errors import ConfigError

FLOWERTUNE_PREAMBLE = ("Below is an instruction that describes a task. "
                       "Write a response that appropriately completes the request.")
FLOWERTUNE_MARKER = "\n### Response:"


def flowertune_text(instruction: str, response: str | None = None, prefix: str = "") -> str:
    """FlowerTune's training text of one record (`response` None: the prompt a model answers)."""
    head = f"{prefix}{FLOWERTUNE_PREAMBLE}\n### Instruction:\n{instruction}{FLOWERTUNE_MARKER}"
    return head if response is None else f"{head} {response}"


def special_prefix(tokenizer) -> str:
    """The special tokens the tokenizer puts before a text by default (its BOS, if any), as text
    that tokenizes back to them."""
    with_sp = list(tokenizer("x")["input_ids"])
    bare = list(tokenizer("x", add_special_tokens=False)["input_ids"])
    at = next((k for k in range(len(with_sp) - len(bare) + 1) if with_sp[k:k + len(bare)] == bare), 0)
    text = "".join(tokenizer.convert_ids_to_tokens(with_sp[:at]))
    if list(tokenizer(text, add_special_tokens=False)["input_ids"]) != with_sp[:at]:
        raise ConfigError(f"model.prompt_template: the tokenizer's leading special tokens {with_sp[:at]} do not "
                          f"tokenize back from their text {text!r}; set model.prompt_template = ''")
    return text


def flowertune_jinja(prefix: str) -> str:
    """FlowerTune's prompt as a Jinja chat template: messages = [user] (the prompt) or [user,
    assistant] (the prompt, then " " and the answer)."""
    head = json.dumps(f"{prefix}{FLOWERTUNE_PREAMBLE}\n### Instruction:\n")
    return ("{%- if messages|length > 2 or messages[0]['role'] != 'user' or (messages|length == 2 and "
            "messages[1]['role'] != 'assistant') -%}{{ raise_exception('model.prompt_template = \"flowertune\" "
            "renders one instruction and its answer') }}{%- endif -%}"
            "{{ " + head + " + messages[0]['content'] + " + json.dumps(FLOWERTUNE_MARKER) + " }}"
            "{%- if messages|length == 2 -%}{{ ' ' + messages[1]['content'] }}{%- endif -%}")


def install(tokenizer, name: str) -> None:
    """Replace the tokenizer's chat template with the named one ("" leaves it as it is)."""
    if name == "flowertune":
        tokenizer.chat_template = flowertune_jinja(special_prefix(tokenizer))
    elif name:
        raise ConfigError(f"model.prompt_template = {name!r}: one of '', 'flowertune'")
