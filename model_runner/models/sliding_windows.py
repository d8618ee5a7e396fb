"""Each layer's sliding window, read from a Hugging Face config: `sliding_window` with
`layer_types` (Gemma 2/3, Qwen2, newer configs), or on every layer when a config has a
window and no layer types (Mistral)."""

from __future__ import annotations

from transformers import PretrainedConfig


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Per layer: its sliding window in tokens (a query sees its own key and the
    window - 1 before it), or None for full attention."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [int(window)] * num_layers
    return [int(window) if kind == "sliding_attention" else None for kind in layer_types]


def model_window(config: PretrainedConfig) -> int | None:
    """The window when every layer has one (the widest), else None: only then may a
    sequence's KV blocks that fall wholly behind it be freed early."""
    windows = layer_windows(config)
    if not windows or None in windows:
        return None
    return max(w for w in windows if w is not None)
