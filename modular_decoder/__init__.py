"""modular_decoder: the decoder-only design space as one transformers model family.

Importing the package registers `ModularDecoderConfig` and the models with `AutoConfig`,
`AutoModel` and `AutoModelForCausalLM`, and marks them for remote code, so a saved folder
carries `auto_map` and the code files and loads with `trust_remote_code=True` anywhere.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import ModularDecoderCache
from .configuration_modular_decoder import ModularDecoderConfig
from .contract import cache_bytes, cache_bytes_per_token, contract_table, parameter_count
from .modeling_modular_decoder import (
    ModularDecoderForCausalLM,
    ModularDecoderModel,
    ModularDecoderPreTrainedModel,
)
from .tools.compiled import compiled_decoding
from .tools.presets import PRESETS, preset_config
from .tools.reshape import reshape

__version__ = "0.1.0"

AutoConfig.register(ModularDecoderConfig.model_type, ModularDecoderConfig, exist_ok=True)
AutoModel.register(ModularDecoderConfig, ModularDecoderModel, exist_ok=True)
AutoModelForCausalLM.register(ModularDecoderConfig, ModularDecoderForCausalLM, exist_ok=True)
ModularDecoderConfig.register_for_auto_class()
ModularDecoderModel.register_for_auto_class("AutoModel")
ModularDecoderForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "ModularDecoderConfig",
    "ModularDecoderModel",
    "ModularDecoderForCausalLM",
    "ModularDecoderPreTrainedModel",
    "ModularDecoderCache",
    "PRESETS",
    "preset_config",
    "parameter_count",
    "cache_bytes",
    "cache_bytes_per_token",
    "contract_table",
    "compiled_decoding",
    "reshape",
]
