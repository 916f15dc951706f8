"""DeciLM (`nemotron-nas`) configuration: a Llama config plus one `block_configs` entry
per layer.

Written by tlm-convert (tapered-lm), minimal: it reads and writes the schema of NVIDIA's Nemotron-NAS checkpoints
(`attention`: n_heads_in_group, no_op, replace_with_linear; `ffn`: ffn_mult, no_op, replace_with_linear,
intermediate_size) and exposes the entries as attribute objects (`config.block_configs[i].ffn.ffn_mult`), which is
how vLLM and SGLang read them.
"""

import dataclasses

from transformers import LlamaConfig


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """The MLP width the serving engines derive from ffn_mult."""
    return find_multiple(int(2 * ffn_mult * hidden_size / 3), 256)


def _known(cls, values):
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in (values or {}).items() if k in names}


@dataclasses.dataclass
class AttentionConfig:
    n_heads_in_group: int = None
    no_op: bool = False
    replace_with_linear: bool = False


@dataclasses.dataclass
class FFNConfig:
    ffn_mult: float = None
    no_op: bool = False
    replace_with_linear: bool = False
    intermediate_size: int = None


@dataclasses.dataclass
class BlockConfig:
    attention: AttentionConfig
    ffn: FFNConfig

    @classmethod
    def from_dict(cls, values):
        attention, ffn = values.get("attention"), values.get("ffn")
        if not isinstance(attention, AttentionConfig):
            attention = AttentionConfig(**_known(AttentionConfig, attention))
        if not isinstance(ffn, FFNConfig):
            ffn = FFNConfig(**_known(FFNConfig, ffn))
        return cls(attention=attention, ffn=ffn)

    def to_dict(self):
        return dataclasses.asdict(self)


class DeciLMConfig(LlamaConfig):
    model_type = "nemotron-nas"

    def __init__(self, block_configs=None, **kwargs):
        super().__init__(**kwargs)
        self.block_configs = [b if isinstance(b, BlockConfig) else BlockConfig.from_dict(b)
                              for b in block_configs or []]

    def to_dict(self):
        output = super().to_dict()
        output["block_configs"] = [b.to_dict() for b in self.block_configs]
        return output


__all__ = ["DeciLMConfig", "BlockConfig", "AttentionConfig", "FFNConfig", "ffn_mult_to_intermediate_size"]
