"""tlm_convert: the conversion of a uniform checkpoint (Llama/Mistral/SmolLM, Qwen2, Qwen3, Gemma 3, GPT-2, TLM)
into a tapered TLM at the same parameter count: calibration, neuron ranking, surgery, refit, mixer upcycling, the
low-memory stream and the heal. Reads and writes checkpoints through tlm_io and trains through
tlm_train."""

__all__ = []
