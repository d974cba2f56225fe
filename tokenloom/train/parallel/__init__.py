"""Model parallelism (Megatron's design) on top of torch.distributed; runs on gloo and NCCL.

Tensor parallelism lives in :mod:`.state` (rank grid and groups), :mod:`.mappings`
(autograd collectives), :mod:`.layers` (parallel embedding and linears),
:mod:`.tp_cross_entropy` (vocab-parallel loss) and :mod:`.random` (per-tp-rank dropout
streams). Import from those modules; this package file re-exports nothing so that
importing one part never pulls in the others.
"""
