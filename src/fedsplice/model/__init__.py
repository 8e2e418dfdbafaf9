"""Backbones for federated fine-tuning: a frozen Hugging Face model, its PEFT modules and a task
scorer, composed by `fedsplice.model.taskmodel.TaskModel` (docs/design.md §10: loading, roles, PEFT
builders, scorers, caches)."""
