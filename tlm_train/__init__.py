"""tlm_train: training TLMs (``tlm train``: recipes, token cache, checkpoints, resume, DDP/FSDP, distillation),
``tlm tokenize`` and the residual-alignment analysis of ``tlm analyze``. Imports only tlm and tlm_io."""
