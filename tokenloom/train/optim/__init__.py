"""Optimizers: AdamW with its parameter groups, the global gradient norm and ``OptimConfig``
(:mod:`.adamw`), the learning-rate schedule (:mod:`.schedule`) and the ZeRO-1 sharded AdamW
(:mod:`.zero`). It may import ``train.kernels``, ``train.parallel`` and ``train.model``; nothing of
checkpoint or the run. Import from the modules; this file re-exports nothing.
"""
