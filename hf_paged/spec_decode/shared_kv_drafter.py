"""`SharedKVDrafterProposer`: drafts with a Gemma 4 assistant (`gemma4_assistant`,
`gemma4_unified_assistant`), a drafter with no K/V of its own that attends over the target's.

Stock drives these assistants with `SinglePositionMultiTokenCandidateGenerator`; this is the same
drafting from the engine's pool. For a request of n committed tokens (the target's pool holds the
K/V of the first n - 1), each of the k drafts is one assistant forward at the constant position n - 1:

    inputs_embeds  = cat(target_embed(last token), hidden)     [1, 1, 2 * target hidden]
    shared K/V     = the target's "store" layers' K/V, one per layer type (the last layer of each type
                     that owns K/V, `kv_sharing_modes`), gathered from the pool's blocks into dense
                     [1, heads, len, dim]: every committed position for full attention, the last
                     `sliding_window + 1` (as many as the pool still holds) for sliding attention
    hidden         = first the target's final hidden state at the position that produced the last
                     committed token (the engine notes it as it commits), then the assistant's own
                     projected output

Each draft is sampled with the target's processors and keyed draws (as `DraftModelProposer`), so the
drafts are coupled to what verification compares them with. Nothing here writes the target's pool.
"""

from __future__ import annotations

import torch

from ..attention.kv_quant import dequantize, dynamic_scales, rotate
from ..core import KVSequence
from ..core.sequence import NULL_BLOCK
from ..worker.sampler import SampleRow, Sampler
from .proposal import Proposal, ProposalRequest

ASSISTANT_MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
_ASSISTANT_CLASSES = ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM")


def is_shared_kv_drafter(model) -> bool:
    """Whether `model` is a Gemma 4 assistant (a drafter that reads its target's K/V), by class or
    config `model_type`."""
    config = getattr(model, "config", None)
    return type(model).__name__ in _ASSISTANT_CLASSES or getattr(config, "model_type", None) in ASSISTANT_MODEL_TYPES


class SharedKVDrafterProposer:
    """Drafts with a Gemma 4 assistant from the target's stored K/V and last hidden state.

    Args:
        assistant: the assistant model (its attention runs dense: "hf_paged" is switched to "sdpa").
        target: the target model (its input embeddings and config).
        target_kv: the target's `KVOwner` (the engine's pool), read, never written.

    Raises:
        ValueError: the assistant does not fit the target (hidden size, vocabulary, layer types).
    """

    needs_hidden_states = True  # the engine keeps the target's final hidden states for it

    def __init__(self, assistant: torch.nn.Module, target: torch.nn.Module, target_kv):
        if not is_shared_kv_drafter(assistant):
            raise ValueError(f"{type(assistant).__name__} is not a Gemma 4 assistant (model_type "
                             f"{ASSISTANT_MODEL_TYPES})")
        if assistant.config._attn_implementation == "hf_paged":  # no cache of its own: dense attention
            assistant.set_attn_implementation("sdpa")
        self.assistant = assistant
        self.embed = target.get_input_embeddings()
        self.kv = target_kv
        text = target.config.get_text_config(decoder=True)
        own = assistant.config.get_text_config()
        backbone = getattr(assistant.config, "backbone_hidden_size", None)
        if backbone != text.hidden_size:
            raise ValueError(f"the assistant was built for a target of hidden size {backbone}, but the target's is "
                             f"{text.hidden_size}")
        self.vocab_size = min(own.vocab_size, self.embed.num_embeddings)
        modes = getattr(text, "kv_sharing_modes", None)
        if not modes:
            raise ValueError(f"the target (model_type={text.model_type!r}) names no layers whose K/V an assistant "
                             "reads (kv_sharing_modes)")
        # Per layer type, the layer whose K/V the assistant's layers of that type read: stock's "store" layer.
        self.sources = {text.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
        missing = sorted(set(own.layer_types) - set(self.sources))
        if missing:
            raise ValueError(f"the assistant has {missing} layers, but the target stores no K/V of that type")
        self.sliding_window = getattr(own, "sliding_window", None)
        self.sampler = Sampler()
        self.num_forwards = 0

    def free(self, request_id: str) -> None:
        """Nothing is kept per request (the target's pool and the engine hold what it reads)."""

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        proposals = []
        for r in requests:
            seq = r.seq
            if r.hidden_state is None or seq is None or r.num_tokens < 1 or seq.num_tokens != len(r.token_ids) - 1 \
                    or seq.num_tokens < 1:
                proposals.append(Proposal([]))  # nothing to draft from (yet): this step verifies no drafts
                continue
            proposals.append(Proposal(self._draft(r, self._shared_kv(seq))))
        return proposals

    def _draft(self, r: ProposalRequest, shared_kv: dict) -> list[int]:
        """Stock's drafting loop (`SinglePositionMultiTokenCandidateGenerator.get_candidates`) for one request."""
        param = next(self.assistant.parameters())
        device, dtype = param.device, param.dtype
        position_ids = torch.tensor([[len(r.token_ids) - 1]], device=device)
        hidden = r.hidden_state.reshape(1, 1, -1).to(device, dtype)
        token = r.token_ids[-1]
        drafts: list[int] = []
        for _ in range(r.num_tokens):
            embed = self.embed(torch.tensor([[token]], device=self.embed.weight.device)).to(device, dtype)
            out = self.assistant(inputs_embeds=torch.cat([embed, hidden], dim=-1), position_ids=position_ids,
                                 shared_kv_states=shared_kv, use_cache=False)
            self.num_forwards += 1
            logits = out.logits[0, -1:, : self.vocab_size].float().clone()
            token = self.sampler(logits, [SampleRow(r.state, tuple(drafts))], with_outputs=False).token_ids[0]
            drafts.append(token)
            hidden = out.last_hidden_state
        return drafts

    def _shared_kv(self, seq: KVSequence) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The store layers' K/V of `seq`'s cached positions, dense [1, heads, len, dim] per layer type."""
        dtype = next(self.assistant.parameters()).dtype
        out = {}
        for layer_type, source in self.sources.items():
            layer = self.kv.layers[source]
            if not layer.is_initialized:
                raise RuntimeError(f"the target's layer {source} holds no K/V yet")
            table = seq.block_tables[layer.group]
            block_size = self.kv.block_size
            end = seq.num_tokens
            # Stock's assistant sees the last window + 1 keys of a sliding layer (its flipped bidirectional mask).
            start = 0 if layer_type != "sliding_attention" or self.sliding_window is None else max(
                0, end - self.sliding_window - 1)
            while start < end and table[start // block_size] == NULL_BLOCK:  # released: no query reads them
                start = (start // block_size + 1) * block_size
            positions = torch.arange(start, end)
            blocks = torch.tensor(table, dtype=torch.long)[positions // block_size].to(layer.keys.device)
            offsets = (positions % block_size).to(layer.keys.device)
            out[layer_type] = tuple(_rows(cache, scale, layer.scales, blocks, offsets, dtype)
                                    for cache, scale in ((layer.keys, layer.key_scales),
                                                         (layer.values, layer.value_scales)))
        return out


def _rows(cache: torch.Tensor, scale_cache: torch.Tensor | None, scales, blocks: torch.Tensor, offsets: torch.Tensor,
          dtype: torch.dtype) -> torch.Tensor:  # [1, num_kv_heads, len, head_dim]
    """cache[blocks, offsets] (a byte page's strided view too), dequantised where the cache is quantised."""
    if scale_cache is None:
        rows = cache[blocks, offsets].to(dtype)  # [len, heads, dim]
    else:  # one-byte payloads move as uint8 (advanced indexing of float8 is missing on some torch builds)
        payload = cache.view(torch.uint8)[blocks, offsets].view(cache.dtype)
        rows = dequantize(payload, scale_cache[blocks, offsets], dtype, nan_scaled=dynamic_scales(scales.quant))
        if scales.quant.rotate:
            rows = rotate(rows)
    return rows.transpose(0, 1).unsqueeze(0).contiguous()
