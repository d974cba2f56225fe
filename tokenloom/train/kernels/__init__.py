"""Fused kernels for the GPT, each op in its own module with the eager reference the other
implementations are tested against: :mod:`.rms_norm`, :mod:`.layer_norm`, :mod:`.swiglu`,
:mod:`.bias_gelu`, :mod:`.rope`, :mod:`.bias_dropout_add`, :mod:`.attention` (SDPA, flex document
masks, a naive oracle) and :mod:`.cross_entropy` (chunked LM-head loss, vocab-parallel ``group``).

Implementations: :mod:`.compiled` (``torch.compile``) and :mod:`.triton_ops` (only when Triton is
installed); :func:`select_kernels` picks a :class:`KernelSet` per device and :func:`choose_compile`
resolves ``compile`` (:mod:`.selector`). The lowest room of ``train``: it imports no other room.
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
