"""train stage.

* :mod:`tokenloom.train.model`: ``GPTConfig`` and ``GPT`` (GPT-2 and Llama flavours).
* :mod:`tokenloom.train.ddp`: our bucketed ``DistributedDataParallel`` and
  ``compute_bucket_assignment_by_size`` (twin of torch's).
* :mod:`tokenloom.train.dist`: ``init_from_env`` (process group from torchrun's env).

Nothing is imported here, so ``import tokenloom.train`` stays cheap (no torch import).
"""
