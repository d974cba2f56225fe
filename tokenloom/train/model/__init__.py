"""The GPT model: its description (:mod:`.config`), layers (:mod:`.blocks`), assembly, losses and
``build_ops`` (:mod:`.gpt`), MoE routing and dispatch (:mod:`.moe`), pipeline stage ranges
(:mod:`.pipeline_split`), FLOPs per token (:mod:`.flops`) and the fp8 linears (:mod:`.fp8`). It may
import ``train.kernels`` and ``train.parallel`` (and the stages below ``train``); nothing of optim,
checkpoint or the run. Import from the modules; this file re-exports nothing.
"""
