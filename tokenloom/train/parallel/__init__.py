"""Model and data parallelism (Megatron's design) on top of torch.distributed; runs on gloo and NCCL.

Tensor parallelism lives in :mod:`.state` (rank grid and groups), :mod:`.mappings` (autograd
collectives), :mod:`.layers` (parallel embedding and linears), :mod:`.tp_cross_entropy`
(vocab-parallel loss) and :mod:`.random` (per-tp-rank dropout streams); pipeline parallelism in
:mod:`.p2p` and :mod:`.schedules`; context parallelism in :mod:`.context`; data parallelism in
:mod:`.ddp` (bucketed DDP) and :mod:`.fsdp`; :mod:`.wgrad` is the weight-gradient linear whose
sinks layers, DDP, ZeRO and the model share. It may import ``train.kernels`` only (and the stages
below ``train``). Import from those modules; this package file re-exports nothing so that
importing one part never pulls in the others.
"""
