"""train stage, in rooms, lowest first; a room imports only rooms before it (tests/test_structure.py):

* ``kernels`` (fused and compiled ops), ``parallel`` (tp, pp, cp, DDP, FSDP), ``model`` (GPT,
  MoE), ``optim`` (AdamW, Muon, schedule, ZeRO-1);
* the run's set-up here: ``config``, ``data``, ``dist``, ``runtime``, ``host_alloc``;
* ``checkpoint`` (commit protocol, format, async save, reshard, HF);
* the run, the rest of this folder (``loop``, ``strategy``, ``launch``, ...).

Nothing is imported here, so ``import tokenloom.train`` stays cheap (no torch).
"""
