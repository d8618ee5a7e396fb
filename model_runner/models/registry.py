"""Which model class serves a checkpoint: config.json's architecture picks it.

A config without `architectures` (a GGUF converted by transformers has none) is read by
its `model_type`, through transformers' own table of causal-LM architectures. To add a
family: write its class (model_runner/models/), then give it a row in `MODEL_CLASSES`.
"""

from __future__ import annotations

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from model_runner.models.gemma import GemmaForCausalLM
from model_runner.models.gpt_oss import GptOssForCausalLM
from model_runner.models.granite import GraniteForCausalLM
from model_runner.models.llama import LlamaForCausalLM
from model_runner.models.moe_models import MoeForCausalLM
from model_runner.models.olmo2 import Olmo2ForCausalLM
from model_runner.models.phi3 import Phi3ForCausalLM
from model_runner.models.smollm3 import SmolLM3ForCausalLM

# config.json's architecture -> the class that serves it
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
}


def architecture(config: PretrainedConfig) -> str:
    """The architecture string of `config` (its first `architectures` entry, else the
    causal-LM architecture of its `model_type`)."""
    names = getattr(config, "architectures", None)
    if names:
        return str(names[0])
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type)


def model_class(config: PretrainedConfig) -> type[LlamaForCausalLM]:
    """The class serving `config`; ValueError naming the supported architectures if none."""
    name = architecture(config)
    if name not in MODEL_CLASSES:
        raise ValueError(
            f"unsupported architecture {name!r} (supported: {', '.join(sorted(MODEL_CLASSES))})"
        )
    return MODEL_CLASSES[name]
