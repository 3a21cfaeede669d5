"""Grouped-query attention on CPU without copying keys and values per query head.

transformers' ``sdpa`` attention repeats every key/value head for each query head it serves
(``repeat_kv``) whenever more than one token is queried under a mask: a verification pass of a few
tree tokens then copies the whole cache each layer, and on a CPU that copy costs more than the
attention itself (measured with the default model, batch 8, 1,024 tokens of context: a 2-token pass
took 199 ms against 99 ms for one token). PyTorch's kernel can read the shared heads directly
(``enable_gqa``); this registers that as the attention implementation ``GROUPED_SDPA``, which the
models' own forward picks up through transformers' ``AttentionInterface``: no modeling code changes.
Everything else (one query token, no mask, GPUs, position biases, soft-capping) goes to ``sdpa``.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

GROUPED_SDPA = "reader_grouped_sdpa"


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (
        groups == 1
        or query.shape[2] == 1
        or attention_mask is None
        or query.device.type != "cpu"
        or any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux", "sinks"))
    )
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    output = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=True,
    )
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, sdpa_mask)


def use_grouped_attention(model: PreTrainedModel) -> None:
    """Switch a model that runs ``sdpa`` attention to ``GROUPED_SDPA`` (same results, fewer copies)."""
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(GROUPED_SDPA)
