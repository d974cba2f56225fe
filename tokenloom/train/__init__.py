"""train stage, in rooms (each a folder whose ``__init__`` says what it may import), lowest first:

* :mod:`tokenloom.train.kernels`: the fused and compiled ops and their selector.
* :mod:`tokenloom.train.parallel`: tensor, pipeline, context and data parallelism (DDP, FSDP).
* :mod:`tokenloom.train.model`: ``GPTConfig`` and ``GPT`` (GPT-2 and Llama flavours), MoE.
* :mod:`tokenloom.train.optim`: AdamW, the learning-rate schedule, ZeRO-1.
* the run's set-up, modules of this folder: ``config``, ``data``, ``dist``, ``runtime``,
  ``host_alloc``.
* :mod:`tokenloom.train.checkpoint`: the commit protocol, tensor format, async save, reshard, HF.
* the run, the rest of this folder: ``loop``, ``strategy``, ``launch``, ``preflight``, ``summary``,
  ``metrics``, ``stop``, ``source_loss``, ``generate``.

A room imports only rooms before it (tests/test_structure.py). Nothing is imported here, so
``import tokenloom.train`` stays cheap (no torch import).
"""
