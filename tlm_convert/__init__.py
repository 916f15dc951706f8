"""tlm_convert: import real checkpoints (Llama/Mistral/SmolLM, Qwen2, Qwen3, Gemma 3, GPT-2) into TLM, and the tools around it."""

__all__ = []
