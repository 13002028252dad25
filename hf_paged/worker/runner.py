"""`ModelRunner`: one packed forward of a transformers model over a `PagedCache`.

The engine's target model and a speculative draft model each own one. A step is a list of `Chunk`s,
one per sequence: the tokens it feeds, their slots, and how many trailing positions need logits.
transformers sees a single row `[1, num_tokens]` with explicit positions; the attention layers see
one `StepMetadata` (built here) that tells the sequences apart.

Decode steps (every sequence feeds one token and samples it) replay a CUDA graph when the runner
has them (`enable_cuda_graphs`, see `cuda_graphs.py`), or on CPU a forward compiled by Inductor
(`enable_cpu_graphs`, see `cpu_graphs.py`), through the same buckets; every other step, and every
step without either, runs eagerly. Either way the step's inputs reach the device through asynchronous copies:
nothing here waits for the device.

A chunk that feeds image placeholders (`Chunk.images`) makes the step run from input embeddings: the
ids' embeddings with the image features written at those positions (`hf.multimodal`); such a step
also carries Qwen's 3-D positions and Gemma 3's key limits where its requests need them. The runner
owns the image encoder and its cache (`place_images`, called by the core before a request is first
scheduled).

Owns the forward and its tensors (ids, positions, the logits index); it does not choose what runs
(the scheduler does) or what is sampled (`sampling.py`).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..attention.metadata import StepMetadata, build_packed_metadata, host_to_device
from ..core import KVSequence
from ..hf import KVOwner, PagedCache, decoder_of
from ..hf.linear import enable as enable_fast_linear, fast_linear
from ..hf.multimodal import ImageEncoder, ImageFeatures, ImageItem, ImageSupport, place
from ..hf import rope as hf_rope
from ..hf.latent import check_latent_rows, install_latent
from ..hf.mixers import install_mixers
from ..hf.state import StateStep
from ..attention.interface import compiled_step
from .cpu_graphs import CompiledCapture, StepAttention, compiled_forward
from .cuda_graphs import DecodeBatch, DecodeGraphs, GraphCaptureError, GraphKey

logger = logging.getLogger(__name__)


@dataclass
class Chunk:
    """One sequence's share of a packed forward.

    Attributes:
        seq: the block manager's record, already extended by this chunk (`append_tokens` ran).
        start: position of the first token (tokens already in the cache before this chunk).
        token_ids: the tokens fed, positions `start .. start + len - 1`.
        group_slots: per KV group, the KV slot of each token (-1: prefix-cache hit, nothing to write).
        num_logits: how many of the last positions need logits (0 for a prompt chunk that stops
            short, 1 to sample, k + 1 to verify k speculative tokens).
        images: the request's image features (`hf.multimodal.ImageFeatures`), written at the
            placeholder positions this chunk feeds; None for a text-only request.
    """

    seq: KVSequence
    start: int
    token_ids: list[int]
    group_slots: list[list[int]]
    num_logits: int
    images: ImageFeatures | None = None

    def image_rows(self) -> tuple[list[int], torch.Tensor] | None:
        """The chunk's placeholder offsets and their feature rows; None when it feeds no placeholder."""
        if self.images is None:
            return None
        offsets, rows = self.images.rows_in(self.start, self.start + len(self.token_ids))
        return (offsets, rows) if offsets else None


@dataclass
class StepInputs:
    """One forward's inputs as host values (lists, and the few tensors images bring): a `Chunk` list made
    plain by `ModelRunner.inputs_for`, so that a process without the scheduler's sequences (a tensor-
    parallel rank) runs the same step. Per token: `input_ids`, `positions`; per sequence: `q_lens`,
    `seq_lens`; `keep`: the token rows whose logits are returned."""

    input_ids: list[int]
    positions: list[int]
    keep: list[int]
    q_lens: list[int]
    seq_lens: list[int]
    copies: list[tuple[int, int]]
    group_slots: list[list[list[int]]]  # [group][sequence][token]
    group_block_tables: list[list[list[int]]]  # [group][sequence][block]
    key_limits: list[int] | None = None
    rope_positions: torch.Tensor | None = None  # [3, 1, num_tokens] (Qwen-VL)
    rope_lens: list[int] | None = None  # per token, the length its rotary frequencies are for (`core.rope`)
    image_rows: list = field(default_factory=list)  # [(first token of the chunk, (offsets, feature rows))]
    state: StateStep | None = None  # recurrent layers: each sequence's state row and copies (`hf.state`)


class ModelRunner:
    """Runs packed forwards of `model` against a cache's blocks; each forward is one `KVOwner` step
    transaction (begin, then commit or abort)."""

    def __init__(self, model: torch.nn.Module, kv: KVOwner | PagedCache):
        self.model = model
        self.kv = kv if isinstance(kv, KVOwner) else kv.kv
        self.cache = self.kv.cache  # the transformers Cache the model's layers write into
        self.device = next(model.parameters()).device
        params = inspect.signature(decoder_of(model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        enable_fast_linear(model)  # inert outside this runner's forwards (see hf.linear)
        self.graphs: DecodeGraphs | None = None  # decode steps replay these when set
        self._compiled = None  # the model's compiled decode forward, once `enable_cpu_graphs` asked for it
        self._cpu_graphs_pending = None  # (buckets, capture, decode steps left) before compiled steps start
        self.image_support = ImageSupport(model)
        self.image_encoder = ImageEncoder(self.image_support) if self.image_support.is_supported else None
        # What a sequence of this model records when its rotary frequencies follow its length (None: they
        # follow positions alone); the model's rotary modules are hooked to read each step's lengths.
        self.length_rope = hf_rope.install(model)
        if self.kv.states is not None:  # recurrent mixers run per sequence in packed steps
            install_mixers(model, self.kv)
        check_latent_rows(self.kv)  # packed steps read latent attention's rows absorbed: not quantised ones
        install_latent(model)  # latent attention reads the paged rows absorbed; indexers select per sequence
        # Wall seconds of the latest forward: building its inputs and metadata, and the model call
        # (for a replay: filling the static inputs, and the replay, plus any capture it needed).
        self.last_metadata_seconds = 0.0
        self.last_model_seconds = 0.0
        # The decoder's final hidden state at each logits row of the latest forward ([len(keep), hidden]),
        # kept only once `keep_hidden_states()` asked for it (a proposer that drafts from them).
        self.last_hidden_states: torch.Tensor | None = None
        self._hidden_source: torch.nn.Module | None = None  # the decoder whose output is read, once asked
        self._step_hidden: torch.Tensor | None = None

    def enable_cuda_graphs(self, batch_sizes: Sequence[int], max_seqlens: Sequence[int], capture=None) -> DecodeGraphs:
        """Replay decode steps from graphs captured for these buckets (`cuda_graphs.batch_size_buckets`,
        `cuda_graphs.max_seqlen_buckets`); `capture` replaces `torch.cuda.CUDAGraph` capture (the
        tests' `EagerGraphCapture`)."""
        self.graphs = DecodeGraphs(self._graph_forward, self.model, self.kv, self.device, batch_sizes,
                                   max_seqlens, capture)
        self._cpu_graphs_pending = None
        return self.graphs

    def enable_cpu_graphs(self, batch_sizes: Sequence[int], max_seqlens: Sequence[int], capture=None,
                          after_steps: int = 0) -> DecodeGraphs | None:
        """Run decode steps compiled by Inductor (`cpu_graphs.py`), per batch bucket, through the same
        `DecodeGraphs` as CUDA graphs (each graph compiles when a step first needs it), once `after_steps`
        decode steps have run eagerly (`config.CPU_GRAPHS_COMPILE_AFTER_STEPS`; None is returned until
        then). `capture` replaces `cpu_graphs.CompiledCapture`."""
        if after_steps > 0:
            self._cpu_graphs_pending = (batch_sizes, max_seqlens, capture, after_steps)
            return None
        self._cpu_graphs_pending = None
        self._compiled = compiled_forward(self.model, self._cache_kwarg)
        self.graphs = DecodeGraphs(self._compiled_graph_forward, self.model, self.kv, self.device, batch_sizes,
                                   max_seqlens, capture if capture is not None else CompiledCapture())
        return self.graphs

    def keep_hidden_states(self) -> None:
        """From now on, keep the decoder's final (normed) hidden state at every logits row of each forward
        in `last_hidden_states` (what stock's `output_hidden_states[-1]` holds there), read by a forward
        hook on the decoder held for the model call only. Decode steps then run eagerly: a replayed
        graph would not run the hook."""
        self._hidden_source = decoder_of(self.model)
        self.graphs = self._cpu_graphs_pending = None

    def _read_hidden(self, module, args, output) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        self._step_hidden = hidden if hidden is not None else output[0]

    def forward(self, chunks: list[Chunk], copies: list[tuple[int, int]],
                new_full_blocks: list[tuple[int, int]] = ()) -> torch.Tensor:
        """Returns [sum(num_logits), vocab] logits, chunk by chunk in order (a replayed step's are a
        view of its graph's output: read them before the next forward).

        Args:
            new_full_blocks: blocks this step fills (`append_tokens(..., register=False)`); they are
                published in the prefix cache once every layer has written its K/V.

        On an exception the cache forgets the step and it propagates; nothing was published."""
        began = time.perf_counter()
        key = None
        placed = [(i, rows) for i, c in enumerate(chunks) if (rows := c.image_rows()) is not None]
        rope = any(c.images is not None and c.images.mrope is not None for c in chunks)  # Qwen-VL's 3-D positions
        self.last_hidden_states = None
        if (self.graphs is not None or self._cpu_graphs_pending is not None) and not copies and not placed \
                and not rope and self.length_rope is None and self.kv.states is None and all(
                len(c.token_ids) == 1 and c.num_logits == 1 for c in chunks):
            if self.graphs is None:
                self._count_eager_decode_step()
            else:
                key = self.graphs.key_for(len(chunks), max((c.seq.num_tokens for c in chunks), default=0))
        if key is not None:
            logits = self._replay(key, chunks, began)
            if logits is not None:
                self.kv.commit(new_full_blocks)
                return logits
            began = time.perf_counter()  # the capture failed and graphs are off: this step runs eagerly
        return self.run(self.inputs_for(chunks, copies, placed), new_full_blocks, began)

    def _count_eager_decode_step(self) -> None:
        """One more decode step ran eagerly before compiled steps start; the last one starts them."""
        batch_sizes, max_seqlens, capture, left = self._cpu_graphs_pending
        if left > 1:
            self._cpu_graphs_pending = (batch_sizes, max_seqlens, capture, left - 1)
        else:
            self.enable_cpu_graphs(batch_sizes, max_seqlens, capture)

    def inputs_for(self, chunks: list[Chunk], copies: list[tuple[int, int]],
                   placed: list | None = None) -> "StepInputs":
        """The step's inputs as plain host values: what `run` (on this process or on another tensor-parallel
        rank, which has no `KVSequence`s) needs to run the same forward."""
        if placed is None:
            placed = [(i, rows) for i, c in enumerate(chunks) if (rows := c.image_rows()) is not None]
        input_ids, positions, keep, starts = [], [], [], []
        for chunk in chunks:
            starts.append(len(input_ids))
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + len(chunk.token_ids)))
            end = len(input_ids)
            keep.extend(range(end - chunk.num_logits, end))
        rope = any(c.images is not None and c.images.mrope is not None for c in chunks)  # Qwen-VL's 3-D positions
        fields = self.kv.group_fields([c.group_slots for c in chunks], [c.seq for c in chunks])
        return StepInputs(
            input_ids=input_ids, positions=positions, keep=keep,
            q_lens=[len(c.token_ids) for c in chunks], seq_lens=[c.seq.num_tokens for c in chunks],
            copies=list(copies), group_slots=fields["group_slots"], group_block_tables=fields["group_block_tables"],
            key_limits=self._key_limits(chunks) if placed else None,
            rope_positions=self._rope_positions(chunks) if rope else None,
            rope_lens=self._rope_lens(chunks) if self.length_rope is not None else None,
            image_rows=[(starts[i], rows) for i, rows in placed],
            state=self._state_step(chunks) if self.kv.states is not None else None)

    def _state_step(self, chunks: list[Chunk]) -> StateStep:
        """The recurrent layers' share of the step, from each sequence's rows (set by the scheduler) and the
        row copies pending (`StateSlots.pending_copies`); the checkpoints it writes are handed to the owner,
        published when the step commits."""
        for c in chunks:
            if c.seq.state_row is None:
                raise RuntimeError(f"sequence {c.seq.seq_id} has no state row (it was not admitted by a scheduler "
                                   "that knows the model's recurrent layers)")
            self.kv.pending_checkpoints.extend(c.seq.state_checkpoints)
            c.seq.state_checkpoints = []
        return StateStep(rows=[c.seq.state_row for c in chunks], has_previous=[c.start > 0 for c in chunks],
                         q_lens=[len(c.token_ids) for c in chunks], saves=[list(c.seq.state_saves) for c in chunks],
                         restores=self.kv.state_slots.take_copies())

    def run(self, inputs: "StepInputs", new_full_blocks: Sequence[tuple[int, int]] = (),
            began: float | None = None) -> torch.Tensor:  # [len(inputs.keep), vocab]
        """One eager forward of `inputs` (one `KVOwner` step transaction); publishes `new_full_blocks`."""
        began = time.perf_counter() if began is None else began
        meta = build_packed_metadata(
            q_lens=inputs.q_lens, seq_lens=inputs.seq_lens, copies=inputs.copies, device=self.device,
            key_limits=inputs.key_limits, group_slots=inputs.group_slots,
            group_block_tables=inputs.group_block_tables, **self.kv.group_layout())
        meta.state = inputs.state
        ids = host_to_device([inputs.input_ids], torch.long, self.device)  # [1, num_tokens]
        pos = host_to_device([inputs.positions], torch.long, self.device)  # [1, num_tokens]
        if inputs.rope_positions is not None:
            pos = inputs.rope_positions.to(self.device, non_blocking=True)  # [3, 1, num_tokens]
        keep_index = host_to_device(inputs.keep, torch.long, self.device)  # [sum(num_logits)]
        embeds = self._embed_with_images(ids, inputs.image_rows) if inputs.image_rows else None
        self.kv.begin(meta)
        called = time.perf_counter()
        self.last_metadata_seconds = called - began
        try:
            with hf_rope.token_lengths(inputs.rope_lens, self.device):
                logits = self._call_model(ids, pos, keep_index, meta, embeds)
        except BaseException:
            self.kv.abort()  # this step published no block
            raise
        self.kv.commit(new_full_blocks)
        self.last_model_seconds = time.perf_counter() - called
        return logits

    def _replay(self, key: GraphKey, chunks: list[Chunk], began: float) -> torch.Tensor | None:
        """A decode step on its graph; None if capturing it failed (graphs are then off for good)."""
        fields = self.kv.group_fields([c.group_slots for c in chunks], [c.seq for c in chunks])
        batch = DecodeBatch(
            token_ids=[c.token_ids[0] for c in chunks],
            positions=[c.start for c in chunks],
            seq_lens=[c.seq.num_tokens for c in chunks],
            group_slots=[[slots[0] for slots in g] for g in fields["group_slots"]],  # one token per sequence
            group_block_tables=fields["group_block_tables"],
        )
        called = time.perf_counter()
        self.last_metadata_seconds = called - began
        try:
            logits = self.graphs.replay(key, batch)
        except GraphCaptureError:
            logger.warning("hf_paged: capturing a decode graph failed; decode steps run eagerly from now on",
                           exc_info=True)
            self.graphs = self._cpu_graphs_pending = None
            self.kv.abort()  # a failed warm-up leaves its step unfinished; the eager run stages afresh
            return None
        except BaseException:
            self.kv.abort()
            raise
        self.last_model_seconds = time.perf_counter() - called
        return logits

    def _call_model(self, ids: torch.Tensor, pos: torch.Tensor, keep_index: torch.Tensor,
                    meta: StepMetadata, embeds: torch.Tensor | None = None) -> torch.Tensor:  # [len(keep_index), vocab]
        inputs = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
        hook = self._hidden_source.register_forward_hook(self._read_hidden) if self._hidden_source is not None else None
        try:
            with torch.inference_mode(), fast_linear():
                out = self.model(**inputs, position_ids=pos, use_cache=True, paged_metadata=meta,
                                 logits_to_keep=keep_index, **{self._cache_kwarg: self.cache})
        finally:
            if hook is not None:
                hook.remove()
        logits = out.logits[0]
        if logits.shape[0] != keep_index.shape[0]:  # a model that ignores logits_to_keep (VideoLLaMA 3): every row
            logits = logits.index_select(0, keep_index)
        if self._hidden_source is not None:
            hidden, self._step_hidden = self._step_hidden, None
            if hidden is not None and hidden.shape[1] == ids.shape[-1]:  # [1, num_tokens, hidden]
                self.last_hidden_states = hidden[0].index_select(0, keep_index)
        return logits

    @staticmethod
    def _key_limits(chunks: list[Chunk]) -> list[int] | None:
        """Per token of the step, the last key position it sees: past itself only inside an image block
        attended both ways (Gemma 3; the scheduler keeps each block in one chunk). None: all causal."""
        per_chunk = [c.images.key_limits(c.start, c.start + len(c.token_ids)) if c.images is not None else None
                     for c in chunks]
        if all(limits is None for limits in per_chunk):
            return None
        return [p for c, limits in zip(chunks, per_chunk)
                for p in (limits if limits is not None else range(c.start, c.start + len(c.token_ids)))]

    def _rope_lens(self, chunks: list[Chunk]) -> list[int]:
        """Per token of the step, the sequence length stock computed it for (`core.rope.LengthRope`)."""
        lens = []
        for c in chunks:
            rope = c.seq.rope or self.length_rope
            lens.extend(rope.rope_len(p) for p in range(c.start, c.start + len(c.token_ids)))
        return lens

    @staticmethod
    def _rope_positions(chunks: list[Chunk]) -> torch.Tensor:  # [3, 1, num_tokens]
        """M-RoPE positions of the step: a request with images takes its own (`ImageFeatures.rope_positions`),
        a text-only one its 1-D positions on every axis (what the model builds from 1-D positions)."""
        parts = []
        for c in chunks:
            end = c.start + len(c.token_ids)
            if c.images is not None and c.images.mrope is not None:
                parts.append(c.images.rope_positions(c.start, end))
            else:
                parts.append(torch.arange(c.start, end).expand(3, -1))
        return torch.cat(parts, dim=1)[:, None, :]

    def _embed_with_images(self, ids: torch.Tensor, placed: list[tuple[int, tuple[list[int], torch.Tensor]]]
                           ) -> torch.Tensor:  # [1, num_tokens, hidden]
        """The step's input embeddings with each chunk's image features at its placeholders (what the
        model's forward does with `masked_scatter`; the placeholders' own ids are never looked up,
        since some models' image token lies outside the embedding table)."""
        index = torch.tensor([start + o for start, (offsets, _) in placed for o in offsets], device=self.device)
        rows = torch.cat([r for _, (_, r) in placed]).to(self.device)
        with torch.inference_mode():
            safe = ids.index_fill(1, index, 0)
            embeds = self.model.get_input_embeddings()(safe)
            embeds[0, index] = rows.to(embeds.dtype)
        return embeds

    def encode_images(self, items: list[ImageItem]) -> tuple[list[torch.Tensor], int]:
        """Features [n_i, hidden] per image (cached ones reused), and how many images the encoder ran on."""
        self.image_support.check()
        before = self.image_encoder.num_encoded
        return self.image_encoder.encode(items), self.image_encoder.num_encoded - before

    def place_images(self, requests: list[tuple[list[int], list[ImageItem]]]) -> tuple[list, int]:
        """Per request (its prompt ids, its images): `(ImageFeatures, block-hash spans)`, or the exception
        that rules it out (a request never fails another's); and how many images the encoder ran on.
        Every missing image of the batch goes through the encoder at once; a failing batch is retried
        request by request."""
        if self.image_encoder is None:
            error = ValueError(f"hf_paged: the engine cannot serve images for this model: {self.image_support.reason}")
            return [error] * len(requests), 0
        before = self.image_encoder.num_encoded
        try:
            features = self.image_encoder.encode([item for _, items in requests for item in items])
        except Exception:  # noqa: BLE001 - retried alone below, so that the culprit alone fails
            features = None
        results, at = [], 0
        for token_ids, items in requests:
            try:
                mine = features[at:at + len(items)] if features is not None else self.image_encoder.encode(items)
                results.append(place(self.image_support, token_ids, items, mine))
            except Exception as exc:  # noqa: BLE001 - handed to the caller, which fails this request
                results.append(exc)
            at += len(items)
        return results, self.image_encoder.num_encoded - before

    def _graph_forward(self, ids: torch.Tensor, pos: torch.Tensor, keep_index: torch.Tensor,
                       meta: StepMetadata) -> torch.Tensor:  # [len(keep_index), vocab]
        """What a decode graph captures: the step begins inside, so that a replay that re-runs it (the
        tests' stand-in) sees a fresh step; a real graph runs only its kernels."""
        self.kv.begin(meta)
        meta.reset_forward_state()  # after: the cache checks that the step it ran last (maybe this one) finished
        return self._call_model(ids, pos, keep_index, meta)

    def _compiled_graph_forward(self, ids: torch.Tensor, pos: torch.Tensor, keep_index: torch.Tensor,
                                meta: StepMetadata) -> torch.Tensor:  # [len(keep_index), vocab]
        """What a compiled decode step runs: the step begins here, the compiled forward computes every
        row's logits (a decode step keeps them all, so `keep_index` is 0 .. B - 1) and each layer's
        attention op writes and attends through this runner's cache with `meta`."""
        self.kv.begin(meta)
        meta.reset_forward_state()
        with torch.inference_mode(), compiled_step(StepAttention(self.cache, meta)):
            return self._compiled(ids, pos)
