"""A mixture-of-experts block (Qwen3-MoE, Qwen2-MoE, Mixtral) in place of a layer's MLP.

A router picks each token's top-k experts (softmax or sigmoid scores, renormalised over
the k when the config asks); each expert is a SwiGLU MLP; a shared expert behind a
sigmoid gate (Qwen2-MoE) sees every token. Shapes: T = tokens, H = hidden size,
E = experts, K = experts per token, I = one expert's intermediate width (this rank's).

The experts' weights are stacked per layer, `w13` [E, 2I, H] (gate rows, then up rows)
and `w2` [E, H, I]. On the CPU the (token, expert) pairs are sorted by expert once per
layer and each expert runs one matmul over its tokens; on CUDA one fused Triton kernel
does the same without a host sync (model_runner/kernels/triton_moe.py).

Tensor parallel: each rank holds its slice of every expert's intermediate width (and of
the shared expert's), so its output is a partial sum; the routed and shared partial sums
are added first and all-reduced once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from model_runner.attention.backend import LayerOps
from model_runner.distributed.tensor_parallel import TensorParallel
from model_runner.models.llama import MLP


def expert_width(config: PretrainedConfig) -> int:
    """One routed expert's intermediate width (Mixtral's is the config's MLP width)."""
    return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


def route(
    logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts from router logits [T, E]: (weights [T, K] float32,
    expert ids [T, K] int64). Scores are computed in float32, as Hugging Face does."""
    scores = logits.float().softmax(-1) if scoring == "softmax" else logits.float().sigmoid()
    weights, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU, the experts' activation unless a family brings its own."""
    return F.silu(gate) * up


def experts_torch(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, K]
    ids: torch.Tensor,  # [T, K]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    b13: torch.Tensor | None = None,  # [E, 2I]
    b2: torch.Tensor | None = None,  # [E, H]
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """Sum over each token's k experts of weight * expert(token): [T, H], an expert being
    down(activation(gate, up)) with the biases `b13` (gate/up) and `b2` (down) if given.

    The T * K (token, expert) pairs are sorted by expert once; each expert with tokens
    runs one matmul over its contiguous run of them."""
    num_tokens, top_k = ids.shape
    flat_ids = ids.flatten()  # [T * K]
    order = flat_ids.argsort(stable=True)  # pairs grouped by expert
    token_of = order // top_k  # [T * K] the token of each sorted pair
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    xs = x[token_of]  # [T * K, H]
    out = torch.empty_like(xs)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            gate_up = F.linear(xs[rows], w13[expert], None if b13 is None else b13[expert])
            gate, up = gate_up.chunk(2, dim=-1)  # [n, I] each
            bias = None if b2 is None else b2[expert]
            out[rows] = F.linear(activation(gate, up), w2[expert], bias)  # [n, H]
            start += count
    out *= weights.flatten()[order].to(out.dtype)[:, None]
    # NOTE: back in (token, k) order and summed over k, rather than index_add_ into the
    # tokens: ~100x faster on the CPU at decode sizes, and the sum's order is fixed
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return unsorted.view(num_tokens, top_k, -1).sum(1)


class MoE(nn.Module):
    """Router, routed experts and (when the config has one) a gated shared expert.

    `rows` and `intermediate_size` are this rank's slice of one expert's width, as for
    the dense MLP; the experts' weights are loaded by model_runner/models/moe_models.py.
    A family that differs sets `router_bias` (a router with a bias) or overrides
    `experts` (its experts' own biases or activation)."""

    router_bias = False

    def __init__(self, config: PretrainedConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = int(getattr(config, "num_experts", None) or config.num_local_experts)
        self.top_k = int(config.num_experts_per_tok)
        self.scoring = str(getattr(config, "scoring_func", "softmax"))
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported router scoring {self.scoring!r} (softmax, sigmoid)")
        # NOTE: Mixtral's config has no norm_topk_prob: it always renormalises
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))
        width = expert_width(config)
        self.rows = (0, width) if tp is None else tp.split(width)
        self.intermediate_size = self.rows[1] - self.rows[0]
        hidden = config.hidden_size
        # the router is replicated: every rank routes every token the same way
        self.gate = nn.Linear(hidden, self.num_experts, bias=self.router_bias)
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_size, hidden))
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, self.intermediate_size))
        shared_width = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        self.shared_expert = MLP(config, tp, shared_width) if shared_width else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_width else None

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; `ops` is taken for the MLP's signature and not used."""
        weights, ids = route(self.gate(x), self.top_k, self.scoring, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + self._shared(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' (partial, under tensor parallelism) output [T, H]: the fused
        Triton kernel on CUDA, the grouped torch path elsewhere."""
        if x.is_cuda:
            from model_runner.kernels.triton_moe import fused_experts

            return fused_experts(x, weights, ids, self.w13, self.w2)
        return experts_torch(x, weights, ids, self.w13, self.w2)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The gated shared expert's (partial, under tensor parallelism) output [T, H]."""
        gate, up = self.shared_expert.gate_up_proj(x).chunk(2, dim=-1)
        out = self.shared_expert.down_proj(F.silu(gate) * up)
        return torch.sigmoid(self.shared_expert_gate(x)) * out
