"""Model and data parallelism (Megatron's design) on torch.distributed, on gloo and NCCL: tensor
(:mod:`.state`, :mod:`.mappings`, :mod:`.layers`, :mod:`.tp_cross_entropy`, :mod:`.random`),
pipeline (:mod:`.p2p`, :mod:`.schedules`), context (:mod:`.context`) and data parallelism
(:mod:`.ddp`, :mod:`.fsdp`); :mod:`.wgrad` is the weight-gradient linear whose sinks layers, DDP,
ZeRO and the model share. It may import ``train.kernels`` only (and the stages below ``train``).
Import from the modules: this file re-exports nothing, so one part never pulls in the others.
"""
