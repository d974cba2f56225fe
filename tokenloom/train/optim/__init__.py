"""Optimizers: AdamW with its parameter groups, the global gradient norm and ``OptimConfig``
(:mod:`.adamw`), the learning-rate schedule (:mod:`.schedule`), the ZeRO-1 sharded AdamW
(:mod:`.zero`) and Muon for the hidden matrices with AdamW for the rest (:mod:`.muon`). It may
import ``train.kernels``, ``train.parallel`` and ``train.model``; nothing of checkpoint or the run.
Import from the modules; this file re-exports nothing.
"""
