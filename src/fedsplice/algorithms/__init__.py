"""Algorithms: one file per method family, each a `build` over typed hyperparameters that
composes a `Recipe` from core parts (a split, loss terms, an objective, a grad transform).

- `recipe`: Recipe, Algorithm, Personal, Phase, Exchange, PromptParts, LoraParts, Beside, NoParams — what a method
  is; ModelSpec, what its `build(params, spec)` sees of the model; Switch and Link, a setting that
  composes onto any method through the task loss.
- `switches`: names -> switches (`[switch.NAME]`): `logit_adjustment`, `grab` (one file each);
  `register_switch` for users' own.
- `hooks`: the hooks' signatures as Protocols (ClientOps, LossTerm, Objective, Fit, Send, ...), checked by mypy.
- `pfadapter`, `fedpurel`: the two methods fedsplice implements exactly.
- `baselines`: the methods the papers compare against; `fedotp`, `fedpgp`, `promptfolio`,
  `pfedlora` and `feddpa`, the baselines with model parts of their own (PromptParts, LoraParts).
- `registry`: names -> algorithms; `register_algorithm` for users' own methods.
"""

from fedsplice.algorithms.hooks import ClientOps
from fedsplice.algorithms.recipe import (
    Algorithm,
    Beside,
    Exchange,
    Link,
    LoraParts,
    ModelSpec,
    NoParams,
    Personal,
    Phase,
    PromptParts,
    Recipe,
    Switch,
    clone,
)
from fedsplice.algorithms.registry import (
    available,
    build_recipe,
    display_name,
    get_algorithm,
    lora_parts,
    method_params,
    prompt_parts,
    register_algorithm,
)
from fedsplice.algorithms.switches import register_switch

__all__ = ["Algorithm", "Beside", "ClientOps", "Exchange", "Link", "LoraParts", "ModelSpec", "NoParams", "Personal",
           "Phase", "PromptParts", "Recipe", "Switch", "available", "build_recipe", "clone", "display_name",
           "get_algorithm", "lora_parts", "method_params", "prompt_parts", "register_algorithm", "register_switch"]
