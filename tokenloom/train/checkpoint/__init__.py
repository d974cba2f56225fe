"""Checkpoints: the commit protocol of a checkpoint directory (:mod:`.commit`), the one tensor format
(:mod:`.format`), the asynchronous saver (:mod:`.async_save`), resharding onto another layout
(:mod:`.reshard`) and the Hugging Face export / import (:mod:`.hf`). It may import ``train.kernels``,
``train.parallel``, ``train.model``, ``train.optim`` and the run set-up modules (``train.config``,
``train.data``, ``train.dist``, ``train.runtime``, ``train.host_alloc``); not the loop, the strategy
or the launcher, which import it. Import from the modules; this file re-exports nothing.
"""
