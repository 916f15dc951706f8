"""tlm_train: training TLMs (``tlm train``: recipes, token cache, checkpoints, resume, DDP/FSDP, distillation),
and ``tlm tokenize``. Imports only tlm and tlm_io."""
