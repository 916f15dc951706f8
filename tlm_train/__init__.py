"""Training, evaluation and analysis of TLMs: ``tlm train`` (recipes, checkpoints, resume, DDP, distillation),
``tlm analyze`` (residual alignment) and ``tlm compare`` (converted vs from scratch)."""
