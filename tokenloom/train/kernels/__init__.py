"""Fused kernels for the GPT, each with a plain PyTorch reference.

One module per op, each holding the eager reference the other implementations are
tested against:

* :mod:`.rms_norm`, :mod:`.layer_norm`: norms (fp32 statistics, output in input dtype).
* :mod:`.swiglu`, :mod:`.bias_gelu`: MLP activations (GELU tanh-approximate or exact).
* :mod:`.rope`: rotary embedding, rotate-half layout (the tables: ``model.rope_tables``).
* :mod:`.bias_dropout_add`: sublayer tail ``residual + dropout(x + bias)``.
* :mod:`.attention`: SDPA (flash on GPU), plus a naive oracle.
* :mod:`.cross_entropy`: LM-head cross entropy chunked over tokens (O(chunk x vocab)
  memory), with a vocab-parallel ``group`` hook.

Implementations: :mod:`.compiled` (``torch.compile``) and :mod:`.triton_ops` (Triton,
only when installed). :func:`select_kernels` picks one per device and returns a
:class:`KernelSet`; :func:`choose_compile` resolves the train config's ``compile``; see
:mod:`.selector` for the rules.
"""

from .attention import attention_reference, attention_sdpa, document_attention_mask, flex_usable
from .bias_dropout_add import bias_dropout_add_reference
from .bias_gelu import bias_gelu_reference
from .cross_entropy import chunked_cross_entropy, cross_entropy_reference
from .layer_norm import layer_norm_reference
from .rms_norm import rms_norm_reference
from .rope import rope_reference
from .selector import MODES, OPS, KernelSet, choose_compile, resolve_mode, select_kernels
from .swiglu import swiglu_reference

__all__ = [
    "MODES",
    "OPS",
    "KernelSet",
    "attention_reference",
    "choose_compile",
    "attention_sdpa",
    "document_attention_mask",
    "flex_usable",
    "bias_dropout_add_reference",
    "bias_gelu_reference",
    "chunked_cross_entropy",
    "cross_entropy_reference",
    "layer_norm_reference",
    "rms_norm_reference",
    "resolve_mode",
    "rope_reference",
    "select_kernels",
    "swiglu_reference",
]
