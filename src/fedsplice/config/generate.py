"""What `model.task = "generate"` (instruction tuning: free-text answers, docs/instruct.md) takes and
refuses, from the config alone. What a method's recipe needs (an objective of its own, a
personalized prediction) is checked where the recipe is built (fedsplice.federation.experiment)."""

from __future__ import annotations

from fedsplice.config.checks import refuse_inert
from fedsplice.errors import ConfigError

DEFAULT_MAX_NEW_TOKENS = 64


def refuse_generate_settings(cfg) -> None:
    """The settings of model.task = "generate", set under another task."""
    m = cfg.model
    refuse_inert("model", m, ("chat_template", "prompt_template"), f"model.task = {m.task!r}",
                 "set model.task = 'generate'")
    refuse_inert("data", cfg.data, ("record_format",), f"model.task = {m.task!r} (records are text and label)",
                 "set model.task = 'generate'")
    refuse_inert("data", cfg.data, ("group_field",), f"model.task = {m.task!r} (classes come from `label`)",
                 "set model.task = 'generate'")
    refuse_inert("eval", cfg.eval, ("stop",), f"model.task = {m.task!r}", "set model.task = 'generate'")
    if cfg.eval.max_new_tokens != DEFAULT_MAX_NEW_TOKENS:
        raise ConfigError(f"eval.max_new_tokens = {cfg.eval.max_new_tokens} does nothing while model.task = "
                          f"{m.task!r} (it bounds generated answers): set model.task = 'generate', or remove it")


def refuse_inert_rendering(cfg) -> None:
    """Under model.task = "generate": how records are read and rendered, where the rest makes it inert."""
    m = cfg.model
    refuse_inert("model", m, ("input_template",), "model.task = 'generate'",
                 "the prompt comes from each record (and the chat template)")
    if m.chat_template == "plain":
        refuse_inert("model", m, ("prompt_template",), "model.chat_template = 'plain' (the plain template "
                     "ignores the tokenizer's)", "set model.chat_template = 'auto' or 'chat'")
    if cfg.data.dataset == "wordnet":
        refuse_inert("data", cfg.data, ("record_format",), "data.dataset = 'wordnet' (its records are built in)",
                     "give the records as jsonl:PATH, csv:PATH or hf:NAME")


def check_generate(cfg) -> None:  # an ExperimentConfig (which calls this: no import back)
    m = cfg.model
    if cfg.data.partition == "natural" and m.task != "generate":
        raise ConfigError("data.partition = 'natural' reads the `client` field of instruction records: set "
                          "model.task = 'generate', or choose dirichlet, iid or shards")
    if m.task != "generate":
        refuse_generate_settings(cfg)
        return
    refuse_inert_rendering(cfg)
    if cfg.data.partition != "dirichlet":
        refuse_inert("data", cfg.data, ("group_field",), f"data.partition = {cfg.data.partition!r}",
                     "set data.partition = 'dirichlet'")
    if cfg.data.partition == "natural":
        refuse_inert("data", cfg.data, ("local_test_size",), "data.partition = 'natural' (each client's local test "
                     "set is its own test records)", "use data.test_per_class for a carved split's size")
    why = "model.task = 'generate' answers in free text; "
    refusals = (
        (cfg.peft.type not in ("lora", "full"), f"peft.type = {cfg.peft.type!r}: {why}prompts, adapters and heads "
                                                "score a class set; use peft.type = 'lora'"),
        (cfg.eval.cold_start_epochs > 0, "eval.cold_start_epochs: cold-start curves are accuracy curves, not yet "
                                         "measured for generated answers; set eval.cold_start_epochs = 0"),
        (cfg.privacy.local == "dpsgd", "privacy.local = 'dpsgd' does not run model.task = 'generate' yet (per-example "
                                       "gradients of the response loss); set privacy.local = 'off'"),
        (cfg.eval.on != "test", "eval.on = 'validation' draws per class; model.task = 'generate' has no classes: "
                                "set eval.on = 'test'"),
        (cfg.scenario.active(), "[scenario] transforms images and class labels; remove it with model.task = "
                                "'generate'"),
        (cfg.data.partition == "shards", "data.partition = 'shards' deals classes to clients; use 'iid', or "
                                         "'dirichlet' over data.group_field"),
        (cfg.data.partition == "dirichlet" and not cfg.data.group_field,
         "data.partition = 'dirichlet' with model.task = 'generate' needs data.group_field (the record field whose "
         "values the clients' shares skew over), or data.partition = 'iid'"),
        (cfg.data.local_test == "disjoint", "data.local_test = 'disjoint' is not built for instruction records yet; "
                                            "use 'global'"),
    )
    for refused, line in refusals:
        if refused:
            raise ConfigError(line)
    kind = cfg.data.dataset.partition(":")[0]
    refuse_inert("data", cfg.data, ("hf_text", "hf_image", "hf_label"), "model.task = 'generate' (a record's "
                 "fields are named by its form: prompt/response, instruction/input/output or messages)",
                 "rename the data set's columns")
    if kind in ("images", "sites"):  # the built-in names are checked against the registry one layer up
        raise ConfigError(f"data.dataset = {cfg.data.dataset!r}: model.task = 'generate' reads instruction records "
                          f"from jsonl:PATH, csv:PATH or hf:NAME (prompt/response, instruction/input/output or "
                          f"messages), or the built-in 'wordnet'")
