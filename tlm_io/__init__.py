"""tlm_io: the floor every command stands on. Reading checkpoints (transformers folders, GGUF, TLM) into TLM
tensors, the one model + tokenizer loader, text and the bundled evaluation sets, perplexity, safe outputs (locks,
atomic publish), export in every format, and the one error root (:class:`tlm_io.errors.TLMError`).

Imports only ``tlm``; tlm_train, tlm_convert and tlm_cli import it (tests/test_imports.py checks the order)."""

__all__ = []
