"""FP8 training (``--fp8``): the blocks' linears as torchao's ``Float8Linear`` (e4m3, dynamic scales,
all three GEMMs), state dict unchanged so checkpoints load across settings. Recipes ``tensorwise``
(fastest) and ``rowwise`` (robust to outliers). The head (maybe tied, most precision-sensitive),
embeddings and norms stay bf16; converted weights bypass the wgrad fusion. :func:`refusal` says
where it cannot run (tp = 1 only: our tp linears are not ``nn.Linear``). torchao is an optional
extra (``tokenloom[fp8]``), imported only when asked for.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

import torch
from torch import nn

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)
"""float8 tensor cores: Ada (8.9), Hopper (9.0) and later."""
ALIGNMENT = 16
"""The float8 GEMM needs both sizes of a weight to be multiples of this."""


def refusal(recipe: str, device: torch.device, *, tp: int, precision: str, kernels: str,
            capability: tuple[int, int] | None = None) -> str | None:
    """Why ``fp8=recipe`` cannot run here (one line with the way out), or None. ``kernels``: the
    resolved mode; ``capability``: looked up when None."""
    if recipe not in RECIPES:
        return f"fp8 must be one of {', '.join(RECIPES)}; got {recipe!r}"
    if device.type != "cuda":
        return f"--fp8 needs a CUDA GPU with float8 tensor cores; this run is on {device.type}"
    capability = capability or torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        have = ".".join(map(str, capability))
        return (f"--fp8 needs float8 tensor cores (compute capability >= {'.'.join(map(str, MIN_CAPABILITY))}: "
                f"Ada, Hopper or later); this GPU has {have}")
    if tp > 1:
        return ("--fp8 serves tp = 1 layouts only (dp, pp, vpp and ZeRO-1 are fine): the tensor-parallel linears "
                "are not nn.Linear, which torchao's float8 training converts")
    if precision == "fp32":
        return "--fp8 trains under bf16 autocast; set precision auto or bf16"
    if kernels != "reference":
        return (f"--fp8 needs the reference ops (model.kernels reference or auto); the {kernels} kernels call the "
                "matmuls themselves and would bypass the float8 linears")
    if importlib.util.find_spec("torchao") is None:
        return "--fp8 needs torchao: pip install 'tokenloom[fp8]'"
    return None


def convertible(module: nn.Module, fqn: str) -> bool:
    """A block linear with :data:`ALIGNMENT`-multiple sizes, not an MoE router (fp32 by contract)."""
    return (isinstance(module, nn.Linear) and fqn.startswith("blocks.") and not fqn.endswith(".router")
            and module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0)


def convert(chunks: Iterable[nn.Module], recipe: str) -> int:
    """Convert the :func:`convertible` linears in place (same parameter objects, tags kept);
    returns how many."""
    from torchao.float8 import (  # lazy: optional dependency (the fp8 extra)
        Float8LinearConfig,
        convert_to_float8_training,
    )

    config = Float8LinearConfig.from_recipe_name(recipe)
    converted = 0
    for chunk in chunks:
        convert_to_float8_training(chunk, module_filter_fn=convertible, config=config)
        converted += sum(is_float8(m) for m in chunk.modules())
    return converted


def is_float8(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's float8 linear (by name: the class is not public API)."""
    return type(module).__name__ == "Float8Linear"
