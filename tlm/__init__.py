"""tlm: Tapered Language Models, transformers-native.

Importing the package registers ``TLMConfig`` / ``TLMForCausalLM`` with transformers' Auto classes, so
``AutoModelForCausalLM.from_pretrained(path)`` loads a TLM checkpoint; saved checkpoints also carry their modeling
code (``auto_map``) and load with ``trust_remote_code=True`` where this package is not installed.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import TLMCache
from .configuration_tlm import TLMConfig
from .mixers import MIXERS
from .modeling_tlm import TLMForCausalLM, TLMModel, TLMPreTrainedModel
from .schedule import SCHEDULES, measured_widths, parse_ratio, taper_widths

__version__ = "0.1.0"

AutoConfig.register("tlm", TLMConfig, exist_ok=True)
AutoModel.register(TLMConfig, TLMModel, exist_ok=True)
AutoModelForCausalLM.register(TLMConfig, TLMForCausalLM, exist_ok=True)
# save_pretrained copies the modeling files next to the weights and writes auto_map for trust_remote_code
TLMConfig.register_for_auto_class()
TLMModel.register_for_auto_class("AutoModel")
TLMForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "TLMConfig",
    "TLMModel",
    "TLMForCausalLM",
    "TLMPreTrainedModel",
    "TLMCache",
    "MIXERS",
    "SCHEDULES",
    "taper_widths",
    "measured_widths",
    "parse_ratio",
]
