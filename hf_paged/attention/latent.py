"""Absorbed multi-head latent attention (MLA): the up-projection folded into the query and the output.

A latent-attention module (DeepSeek V2/V3) caches per token a latent `c` (L = `kv_lora_rank`) and a
rotary key `r` (R = `qk_rope_head_dim`) and expands them per head with `kv_b_proj`, whose weight,
viewed `[H, P + V, L]`, is `W_UK` (`[H, P, L]`, P = `qk_nope_head_dim`) over `W_UV` (`[H, V, L]`):
key `[W_UK c | r]`, value `W_UV c`. Since `q_nope . (W_UK c) = (q_nope W_UK) . c` and
`sum_j p_j W_UV c_j = W_UV sum_j p_j c_j`, attention can read the cached rows `[c | r]` as one shared
head of width L + R, with the query `[q_nope W_UK | q_rot]` and the output `o W_UV^T`:

    query [T, H, P + R] --absorb--> [T, H, L + R]   (one K/V head: rows [.., 1, L + R], V = rows[..., :L])
    out   [T, H, L]     --expand--> [T, H, V]

Per cached token and layer a decode step reads L + R elements instead of H (P + R + V) after the
expansion (FlashMLA's and vLLM's MLA decode). The same up to float rounding, not bit for bit.
"""

from __future__ import annotations

import torch


def absorb_refusal(module: torch.nn.Module) -> str | None:
    """Why `module.kv_b_proj` cannot be absorbed now (None: it can): it is no longer a plain `nn.Linear`
    without bias (replaced since the model was served: a LoRA adapter, a bias), so its weight alone is
    not the up-projection."""
    proj = module.kv_b_proj
    if type(proj) is torch.nn.Linear and proj.bias is None:
        return None
    return (f"hf_paged: {type(module).__name__}.kv_b_proj is now a {type(proj).__name__} (bias="
            f"{getattr(proj, 'bias', None) is not None}), whose weight alone is not the up-projection absorbed "
            "attention folds into the query; build a new Engine (generate() runs such a model dense) or load it "
            "with attn_implementation='sdpa'")


def up_projections(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, P, L], W_UV [H, V, L]): views of `module.kv_b_proj.weight` (H: the heads this module
    holds, a tensor-parallel rank's share); `absorb_refusal` says when they are not the up-projection."""
    nope, v = module.qk_nope_head_dim, module.v_head_dim
    proj = module.kv_b_proj
    weight = proj.weight  # [H * (P + V), L]
    if hasattr(weight, "to_local"):  # a tensor-parallel DTensor: this rank's heads (kv_b_proj is split by rows)
        weight = weight.to_local()
    w = weight.view(weight.shape[0] // (nope + v), nope + v, weight.shape[1])
    return w[:, :nope], w[:, nope:]


def absorb_query(module: torch.nn.Module, query: torch.Tensor) -> torch.Tensor:  # [T, H, L + R]
    """`query` [T, H, P + R] (`[q_nope | q_rot]`, as the module concatenates them) as a query over the rows."""
    w_uk, _ = up_projections(module)
    nope = module.qk_nope_head_dim
    q_latent = torch.einsum("thp,hpl->thl", query[..., :nope], w_uk.to(query.dtype))
    return torch.cat((q_latent, query[..., nope:]), dim=-1)


def expand_output(module: torch.nn.Module, out: torch.Tensor) -> torch.Tensor:  # [T, H, V]
    """Attention's output over the latents, `out` [T, H, L], as the per-head values' mix."""
    _, w_uv = up_projections(module)
    return torch.einsum("thl,hvl->thv", out, w_uv.to(out.dtype))


def is_latent_call(module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether a paged call hands `module` latent rows: one head whose V is the first columns of K's
    rows (`layer.LatentLayer.paged_kv`), from a module with an up-projection to absorb."""
    return (getattr(module, "kv_b_proj", None) is not None and key.dim() == 4 and key.shape[2] == 1
            and value.data_ptr() == key.data_ptr() and value.shape[-1] < key.shape[-1])
