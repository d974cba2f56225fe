"""FP8 training (``fp8``: ``--fp8``): the transformer blocks' linears as torchao's float8 linears.

:func:`torchao.float8.convert_to_float8_training` swaps each ``nn.Linear`` for a
``Float8Linear`` that casts its input, weight and output gradient to float8 (e4m3) with
dynamic scales and runs the three GEMMs of forward and backward on the float8 tensor cores;
the parameters, their names and the state dict stay those of the bf16 model, so checkpoints
load across ``fp8`` settings. Recipes (torchao's names):

* ``tensorwise``: one scale per tensor; the fastest, the one torchao tunes for compile.
* ``rowwise``: one scale per row (axiswise), more robust to outliers, a little slower.

What is converted: the block linears (``qkv``, attention and MLP projections, ``fc``) whose
sizes are multiples of 16 (the float8 GEMM's alignment). The LM head stays bf16 (it may be
tied to the embedding, and its logits are the most precision-sensitive matmul, torchao's
own advice), as do the embeddings and norms. The price of the swap: torchao's linear
replaces ours, so these weights' gradients take autograd's path into the DDP/ZeRO-1 buckets
instead of the weight-gradient fusion (:mod:`tokenloom.train.parallel.wgrad`).

Where it runs (:func:`refusal` says why not, in one line): a CUDA GPU with float8 tensor
cores (compute capability 8.9: Ada, Hopper and later), bf16 autocast, the reference ops
(the other kernel modes call ``F.linear`` on the weight themselves and would bypass the
float8 linear), and tp = 1: tensor-parallel linears are our own modules, not ``nn.Linear``,
and torchao's float8 tensor parallelism needs DTensor. dp, pp, vpp and ZeRO-1 change only
which blocks and optimizer state a rank holds, so they are served.

torchao is an optional extra (``pip install tokenloom[fp8]``) imported here only when a run
asks for fp8: it is a large package with CUDA extensions that most runs do not need.
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
    """Why ``fp8=recipe`` cannot run on ``device`` in this layout (one line naming the reason
    and the way out), or None when it can. ``kernels`` is the mode the model resolves to;
    ``capability`` the device's (looked up when None)."""
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
    """Whether the linear at ``fqn`` (a name inside a model chunk) becomes a float8 linear:
    a block's linear whose sizes are multiples of :data:`ALIGNMENT`, except an MoE router (fp32 by contract)."""
    return (isinstance(module, nn.Linear) and fqn.startswith("blocks.") and not fqn.endswith(".router")
            and module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0)


def convert(chunks: Iterable[nn.Module], recipe: str) -> int:
    """Swap the :func:`convertible` linears of every chunk for torchao's float8 linears with
    ``recipe``'s scaling, in place (same parameter objects, so their tags and the optimizer's
    view of them are kept). Returns how many were converted."""
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
    """Whether ``module`` is torchao's float8 linear (its class is not public API in torchao, so
    it is recognised by name rather than imported)."""
    return type(module).__name__ == "Float8Linear"
