"""`Engine`: continuous batching over a transformers model with a paged KV cache.

Each `step()` is

    schedule (core.scheduler) -> one StepMetadata -> one packed forward [1, num_tokens] with explicit
    positions and no padding (worker.runner) -> logits only where a request samples -> one batched
    sampler call over every row (worker.sampler) -> update

Requests join and leave at every step; long prompts are chunked; when blocks run out the newest
request is preempted and later recomputed (mostly from the prefix cache).

    engine = hf_paged.Engine(model, tokenizer)
    outputs = engine.generate(["Hello!", "Tell me a joke."], hf_paged.SamplingParams(max_new_tokens=64))
    for out in engine.stream("Once upon a time", hf_paged.SamplingParams(max_new_tokens=32)):
        print(out.text, end="")

This module owns the loop and the per-request state between steps; it never computes a slot or
an address (the scheduler and block manager do), never runs tensors beyond routing logits rows, and
leaves input checks (`inputs.py`), pool sizing (`kv_budget.py`), text (`outputs.py`) and metrics
(`metrics.py`) to their modules.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence as SequenceABC

import torch

from ..attention import ATTN_IMPLEMENTATION
from ..config import EngineConfig, PagedCacheConfig
from ..core import KVSequence, Request, RequestStatus, ScheduledRequest, Scheduler, SchedulerOutput
from ..hf import PagedCache, check_model_supported, invalidate, weights_fingerprint
from ..hf.support import check_paged_attention_supported
from ..spec_decode import ProposalRequest, make_proposer, verify_greedy
from ..worker import Chunk, ModelRunner
from ..worker.cuda_graphs import batch_size_buckets, check_cuda_graphs, max_seqlen_buckets
from ..worker.sampler import SampleRow, Sampler, SamplerOutput, TokenLogprobs, logprobs_of
from ..sampling_params import SamplingParams
from ..worker.sampling import SamplingState, draw_seed, sample_seed
from .delivery import Inbox, RequestHandle, drain
from .detokenizer import IncrementalDetokenizer
from .inputs import as_params_list, as_prompt_list, as_token_id_list, model_eos_token_ids, prompt_token_ids
from .kv_budget import default_num_blocks
from .metrics import EngineMetrics, RequestMetrics
from .outputs import CompletionOutput, RequestOutput, StreamEvent

logger = logging.getLogger(__name__)

# A request whose steps raise this many times ends with finish_reason="error" (a transient failure
# is retried: the step is undone and the request recomputed); so does every unfinished request when
# this many steps in a row fail before any request could be blamed (scheduling).
MAX_STEP_FAILURES = 3


class RequestError(ValueError):
    """A failure that belongs to one request and will not go away on a retry (NaN logits)."""


class EngineClosedError(RuntimeError):
    """A call on an engine that can no longer serve it: shut down (`Engine.shutdown`), or, for
    `AsyncEngine`, one whose background loop is not running."""


class _Group:
    """The `n` samples of one request. Sample 0 is the request itself; it runs alone until its prompt
    is computed, then the others fork from it (sharing every block, copy-on-write)."""

    def __init__(self, request_id: str, n: int, retain_kv: bool = False):
        self.request_id = request_id
        self.n = n
        self.members: list[_Tracked | None] = [None] * n
        # retain_kv: each sample's sequence outlives it (`Engine.kept_kv`), for a caller continuing it.
        self.retain_kv = retain_kv
        self.kept: list[KVSequence | None] = [None] * n
        self.forked = n == 1  # nothing to fork
        self.unforked_reason: str | None = None
        self.prompt_logprobs: dict[int, TokenLogprobs] = {}

    @property
    def finished(self) -> bool:
        return self.forked and all(m is not None and m.finish_reason is not None for m in self.members)


class _Tracked:
    """Engine-side state of one request (or one sample of it): the scheduler's view plus sampling,
    text, what it returns besides tokens, and its owner."""

    def __init__(self, request: Request, params: SamplingParams, metrics: RequestMetrics,
                 detok: IncrementalDetokenizer | None, inbox: Inbox | None, index: int, state: SamplingState,
                 group: _Group, sample_index: int = 0):
        self.request = request
        self.params = params
        self.state = state  # the sampler's view: penalty and n-gram state kept as tokens come
        self.metrics = metrics
        self.detok = detok  # streamed text and stop strings; None: text decoded once at the end
        self.inbox = inbox  # the owner's (generate / stream / submit); None for add_request
        self.index = index  # position in the owner's prompts
        self.group = group  # the request's samples (a group of one when n = 1)
        self.sample_index = sample_index
        group.members[sample_index] = self
        self.finish_reason: str | None = None
        self.text: str | None = None
        self.error: Exception | None = None
        self.num_failures = 0
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.scores: list[torch.Tensor] | None = [] if params.output_scores else None
        self.logits: list[torch.Tensor] | None = [] if params.output_logits else None
        self.kv_prefix: KVSequence | None = None  # a kept sequence it takes over when queued
        self.pending_text = ""  # text of `resume_tokens`, prepended to the first streamed delta

    @property
    def public_id(self) -> str:
        """The id the caller knows (the request's, for every one of its samples)."""
        return self.group.request_id

    @property
    def output_ids(self) -> list[int]:
        return self.request.token_ids[self.request.num_prompt_tokens:]


class Engine:
    """Continuous-batching generation for a transformers causal LM.

    Its keyword defaults are `config.EngineConfig`'s: `Engine(model, tokenizer, **EngineConfig(...).engine_kwargs())`
    builds one from a config.

    Args:
        model: a decoder-only transformers model. It is switched to `attn_implementation="hf_paged"`
            if needed (forwards without the engine's metadata still run transformers' own sdpa).
        tokenizer: optional; needed for string prompts, `.text` and stop strings.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one forward (decodes plus prefill chunks).
        block_size, kv_cache_dtype, kv_quant_scheme, kv_quant_rotation, enable_prefix_caching, enable_hybrid_kv,
        cache_salt: see
            `PagedCacheConfig` (`kv_cache_dtype` takes the names of `config.KV_CACHE_DTYPES`; a quantised
            cache honours a checkpoint's own `k_scale` / `v_scale`).
        num_blocks: fixed KV pool size in blocks. Default: from `max_kv_bytes`.
        max_kv_bytes: KV budget in bytes. Default: 2 GiB on CPU, half the free memory on CUDA, capped
            at what `max_num_seqs` full-length sequences need.
        max_model_len: longest sequence (prompt + output); default the model's max positions.
        show_progress: tqdm bar in `generate`; None = only when stderr is a terminal.
        draft_model: a smaller causal LM sharing the tokenizer: speculative decoding with it.
        speculative_method: "draft_model" (implied by `draft_model`), "ngram" (prompt lookup) or None.
        num_speculative_tokens: tokens drafted per step and request (default 5 when speculating, at
            at most `config.MAX_SPECULATIVE_TOKENS`); `SamplingParams.num_speculative_tokens` overrides it per request (0 = off).
        prompt_lookup_min, prompt_lookup_max: n-gram sizes the "ngram" proposer tries.
        eos_token_ids: end-of-sequence ids; default the model's generation config's (then its
            config's, then the tokenizer's).
        cuda_graphs: replay decode steps (every request feeds one token: no prefill chunk, no
            speculative verify) from CUDA graphs (`worker/cuda_graphs.py`). None (default): on for a
            CUDA model with the Triton backend, off elsewhere; True where graphs cannot run is a
            ValueError. Graphs are captured per (batch bucket, max_seqlen_k bucket) the first time a
            step needs one; other steps run eagerly.
        cuda_graph_batch_sizes: the batch buckets (default 1, 2, 4, ... and `max_num_seqs`); a decode
            step of more sequences than the largest runs eagerly.
        cuda_graph_max_seqlens: the max_seqlen_k buckets (default 256, 512, ... and the longest sequence
            the pool and `max_model_len` allow); a step whose longest sequence exceeds the largest runs
            eagerly.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        max_num_seqs: int = EngineConfig.max_num_seqs,
        max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
        block_size: int = EngineConfig.block_size,
        num_blocks: int | None = EngineConfig.num_blocks,
        max_kv_bytes: int | None = EngineConfig.max_kv_bytes,
        kv_cache_dtype: str = EngineConfig.kv_cache_dtype,
        kv_quant_scheme: str = EngineConfig.kv_quant_scheme,
        kv_quant_rotation: bool = EngineConfig.kv_quant_rotation,
        enable_prefix_caching: bool = EngineConfig.enable_prefix_caching,
        enable_hybrid_kv: bool = EngineConfig.enable_hybrid_kv,
        cache_salt: str | None = EngineConfig.cache_salt,
        max_model_len: int | None = EngineConfig.max_model_len,
        show_progress: bool | None = None,
        draft_model: torch.nn.Module | None = None,
        speculative_method: str | None = EngineConfig.speculative_method,
        num_speculative_tokens: int | None = EngineConfig.num_speculative_tokens,
        prompt_lookup_min: int = EngineConfig.prompt_lookup_min,
        prompt_lookup_max: int = EngineConfig.prompt_lookup_max,
        eos_token_ids: int | SequenceABC[int] | None = None,
        cuda_graphs: bool | None = EngineConfig.cuda_graphs,
        cuda_graph_batch_sizes: SequenceABC[int] | None = EngineConfig.cuda_graph_batch_sizes,
        cuda_graph_max_seqlens: SequenceABC[int] | None = EngineConfig.cuda_graph_max_seqlens,
    ):
        check_model_supported(model.config)
        check_paged_attention_supported(model.config)  # packed steps need attention over the blocks
        Scheduler.check_limits(max_num_seqs, max_num_batched_tokens)
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.tokenizer = tokenizer
        text = model.config.get_text_config(decoder=True)
        self.max_model_len = max_model_len or getattr(text, "max_position_embeddings", None) or 1 << 30
        # Held while encoding (prompts here, chat templates in the server): a fast tokenizer whose
        # settings change on an encode (truncation, padding) must not be written from two threads.
        self.tokenizer_lock = threading.Lock()
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.device = next(model.parameters()).device
        self.show_progress = show_progress
        probe = PagedCacheConfig(  # validates the knobs before any sizing
            block_size=block_size, num_blocks=num_blocks, max_kv_bytes=max_kv_bytes, kv_cache_dtype=kv_cache_dtype,
            kv_quant_scheme=kv_quant_scheme, kv_quant_rotation=kv_quant_rotation,
            enable_prefix_caching=enable_prefix_caching, enable_hybrid_kv=enable_hybrid_kv, cache_salt=cache_salt,
        )
        cache_config = replace(probe, max_kv_bytes=None, num_blocks=num_blocks or default_num_blocks(
            model, probe, max_num_seqs, self.max_model_len, self.device))
        self.cache = PagedCache(model.config, cache_config)
        self.cache.use_checkpoint_kv_scales(model)
        self.scheduler = Scheduler(self.cache.manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        self.eos_token_ids = (model_eos_token_ids(model, tokenizer) if eos_token_ids is None
                              else as_token_id_list(eos_token_ids))
        self.runner = ModelRunner(model, self.cache)
        longest = min(self.max_model_len, self.cache.pool.num_blocks * self.cache.block_size)
        graph_buckets = (batch_size_buckets(max_num_seqs, cuda_graph_batch_sizes),
                         max_seqlen_buckets(longest, cuda_graph_max_seqlens))
        if check_cuda_graphs(cuda_graphs, model, self.device):
            self.runner.enable_cuda_graphs(*graph_buckets)
        self.sampler = Sampler()
        self.proposer, self.num_speculative_tokens = make_proposer(
            draft_model=draft_model, method=speculative_method, num_tokens=num_speculative_tokens,
            lookup_min=prompt_lookup_min, lookup_max=prompt_lookup_max, target_num_blocks=self.cache.pool.num_blocks,
            max_num_seqs=max_num_seqs, block_size=self.cache.block_size, kv_cache_config=cache_config)
        self._requests: dict[str, _Tracked] = {}  # live requests (and samples), registered before they are queued
        self._groups: dict[str, _Group] = {}  # live requests by the id the caller knows
        self._ids = itertools.count()
        self._metrics = EngineMetrics()
        # Requests the step in progress advanced (by the id the caller knows), their outputs built once
        # at its end: a request of n samples costs one output per step, not one per sample.
        self._updates: dict[str, _Tracked] = {}
        self._consecutive_failed_steps = 0
        # Sequences finished requests left to their caller (`retain_kv`), by seq_id, until handed to a
        # new request (`kv_prefix`), freed (`free_kv`, or `release_kv_later` from any thread and any
        # moment, a finaliser's) or evicted when the pool runs dry.
        self._held: dict[int, KVSequence] = {}
        self._to_release: deque[KVSequence] = deque()
        self._finished_groups: dict[str, _Group] = {}
        # Threads: `_lock` guards all engine state and is held for a whole step, so nothing changes
        # under a running forward. Other threads hand work to a running loop through `_inbox`.
        self._lock = threading.RLock()
        self._registry_lock = threading.Lock()  # `_requests` alone: submitters never wait for a step
        self._inbox: deque[tuple] = deque()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_mode: str | None = None
        self._closed = False  # `shutdown()`: every later call raises EngineClosedError

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | SequenceABC[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request and return its id. Its outputs come back from `step()`.

        Args:
            prompt: a string (needs a tokenizer) or a list of token ids.
            sampling_params: defaults to `SamplingParams()` (greedy, 16 new tokens).
            request_id: unique among live requests; generated when omitted.

        Raises:
            ValueError/TypeError: naming what is wrong with this request; nothing is queued.
        """
        return self.add_owned_request(prompt, sampling_params, request_id, inbox=None, index=0)

    def submit(self, prompt: str | SequenceABC[int], sampling_params: SamplingParams | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue one request from any thread; returns a `RequestHandle` to wait for its result
        (`.result(timeout)`) or iterate over its `StreamEvent`s. With `start()`ed engines the
        background loop runs it; otherwise the handle runs steps when asked for its result.

        Raises:
            ValueError/TypeError: naming what is wrong with this request; nothing is queued.
        """
        inbox = Inbox(wants_tokens=True)
        return RequestHandle(self, self.add_owned_request(prompt, sampling_params, request_id, inbox, 0, streamed=True), inbox)

    def add_owned_request(self, prompt, sampling_params: SamplingParams | None, request_id: str | None,
                          inbox: Inbox | None, index: int = 0, streamed: bool = False,
                          kv_prefix: KVSequence | None = None, retain_kv: bool = False,
                          resume_tokens: SequenceABC[int] = ()) -> str:
        """`add_request` for a front that collects outputs itself (`generate`, `stream`, handles,
        `AsyncEngine`): every token (and the end) of the request is put in `inbox`, whoever steps.

        Args:
            index: the request's position among its owner's prompts (`StreamEvent.index`).
            streamed: text arrives incrementally (a detokenizer runs per token).
            kv_prefix: a sequence this engine kept (`kept_kv`) holding the K/V of the prompt's first
                tokens: the request takes it over and computes only the rest. If it was evicted or
                freed meanwhile, the request computes everything (from the prefix cache where it can).
            retain_kv: keep each sample's sequence when it finishes (`kept_kv`); the caller frees it.
            resume_tokens: tokens already generated for this prompt by another engine (disaggregated
                prefill): the request continues after them exactly as if it had generated them itself
                (penalties, positions, `max_new_tokens`, text), and returns them as its first output
                tokens. Their logprobs are not known here. Needs n = 1.
        """
        self._check_open()
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to the Engine")
        if isinstance(prompt, str):
            with self.tokenizer_lock:
                prompt_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size)
        else:
            prompt_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size)
        resume = [int(t) for t in resume_tokens]
        if resume:
            if params.n != 1:
                raise ValueError("resume_tokens needs a request with n=1")
            if len(resume) >= params.max_new_tokens:
                raise ValueError(f"{len(resume)} resume_tokens leave nothing to generate within "
                                 f"max_new_tokens={params.max_new_tokens}")
            prompt_token_ids(resume, None, self.vocab_size)  # ids inside the vocabulary
        if len(prompt_ids) + len(resume) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within the model's "
                f"max_model_len={self.max_model_len}"
            )
        known = list(prompt_ids) + resume  # what the request's sequence will hold
        if kv_prefix is not None and (not isinstance(kv_prefix, KVSequence) or kv_prefix.num_tokens >= len(known)
                                      or kv_prefix.token_ids != known[: kv_prefix.num_tokens]):
            raise ValueError("kv_prefix must be a KVSequence holding a proper prefix of the prompt's tokens")
        max_total = min(len(prompt_ids) + params.max_new_tokens, self.max_model_len)
        if not self.scheduler.can_ever_fit(max_total):
            raise ValueError(
                f"request may grow to {max_total} tokens, which needs {self.scheduler.max_blocks_for(max_total)} "
                f"KV blocks of {self.cache.block_size}, but the pool has only {self.cache.pool.num_blocks}; "
                "shorten the prompt or max_new_tokens, or enlarge the pool"
            )
        detok = None
        if self.tokenizer is not None and (streamed or params.stop_strings):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
                                           stop_strings=params.stop_strings)
            # Their text comes out with this engine's first event, so that the streamed deltas join
            # to the whole output's text (the other engine's own text may have held back a partial
            # character or a stop-string prefix).
            resume_text = "".join(detok.add(token) for token in resume)
        with self._registry_lock:  # ids are unique among live requests, whichever thread adds them
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
                while request_id in self._requests or request_id in self._groups:
                    request_id = f"req-{next(self._ids)}"
            elif request_id in self._requests or request_id in self._groups:
                raise ValueError(f"request_id {request_id!r} is already in use by a live request")
            request = Request(request_id=request_id, token_ids=known, num_prompt_tokens=len(prompt_ids),
                              max_total_tokens=max_total, seq=self.cache.new_sequence(),
                              use_prefix_cache=params.prompt_logprobs is None)  # its prompt's logits are needed
            metrics = RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(prompt_ids))
            seed = draw_seed(params.seed)
            tracked = _Tracked(request, params, metrics, detok, inbox, index, self._new_state(params, seed, request),
                               _Group(request_id, params.n, retain_kv))
            tracked.kv_prefix = kv_prefix
            if resume and detok is not None:
                tracked.pending_text = resume_text
            self._requests[request_id] = tracked  # registered first: a step never meets an unknown id
            self._groups[request_id] = tracked.group
        self._post(("add", tracked))
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its output so far (None if unknown).

        Safe from any thread: it takes effect between steps, never under a running forward."""
        box: list = []
        self._post(("abort", request_id, box))
        return box[0] if box else None

    def _post(self, command: tuple) -> None:
        """Apply `command` now if no step is running, else hand it to the running loop."""
        if self.is_running() and threading.current_thread() is not self._thread:
            done = threading.Event()
            self._inbox.append((*command, done))
            self._wakeup.set()
            if command[0] == "abort":
                while not done.wait(0.1):  # the loop applies it before its next step
                    if not self.is_running():  # it stopped meanwhile: apply it here
                        with self._lock:
                            self._apply_inbox()
            return
        with self._lock:
            self._apply_inbox()
            self._apply(command)

    def _apply_inbox(self) -> None:
        while self._to_release:
            seq = self._to_release.popleft()
            if self._held.get(seq.seq_id) is seq:
                del self._held[seq.seq_id]
                self.cache.manager.free(seq)
        while self._inbox:
            *command, done = self._inbox.popleft()
            try:
                self._apply(tuple(command))
            finally:
                done.set()

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            tracked = command[1]
            if self._closed:  # it passed the check as `shutdown()` ran: it ends at once
                prefix, tracked.kv_prefix = tracked.kv_prefix, None
                if prefix is not None:
                    self.free_kv([prefix])
                self._fail(tracked, EngineClosedError("the engine was shut down before this request was queued"))
                return
            prefix, tracked.kv_prefix = tracked.kv_prefix, None
            if prefix is not None and self._held.get(prefix.seq_id) is prefix:
                del self._held[prefix.seq_id]
                tracked.request.seq = prefix  # admission starts after its tokens (`Scheduler.schedule`)
            self.scheduler.add(tracked.request)
        elif command[0] == "abort":
            group = self._groups.get(command[1])
            if group is not None:
                for member in list(group.members):  # every sample of the request
                    if member is not None:
                        self._finish(member, "abort", report=False)  # the caller gets it, not step()
                command[2].append(self._output(group.members[0]))

    # ------------------------------------------------------------------ kept sequences (retain_kv)
    def _keep(self, tracked: _Tracked, seq: KVSequence) -> None:
        """Hold a finished sample's sequence for its caller: the K/V of every token fed to the model
        (all but the last sampled one)."""
        extra = seq.num_tokens - (len(tracked.request.token_ids) - 1)
        if extra > 0:
            try:
                self.cache.manager.truncate(seq, extra)
            except ValueError:  # a sliding group released what that would need: keep nothing
                self.cache.manager.free(seq)
                return
        self._held[seq.seq_id] = seq
        tracked.group.kept[tracked.sample_index] = seq

    def kept_kv(self, request_id: str) -> list[KVSequence | None]:
        """The sequences a finished `retain_kv` request left (one per sample, None where nothing was
        kept), now owned by the caller: hand one to a new request (`kv_prefix`), or `free_kv` it."""
        with self._lock:
            group = self._finished_groups.pop(request_id, None)
            return list(group.kept) if group is not None else []

    def drop_unclaimed_kv(self) -> None:
        """Free what was kept for requests whose caller never collected it (`kept_kv`), and what
        `release_kv_later` queued. Only between calls: a caller still running may collect later."""
        with self._lock:
            self._apply_inbox()
            groups, self._finished_groups = list(self._finished_groups.values()), {}
            self.free_kv(seq for group in groups for seq in group.kept)

    def holds(self, seq: KVSequence) -> bool:
        """Whether `seq` is a kept sequence of this engine (not evicted, freed or handed on)."""
        return self._held.get(seq.seq_id) is seq

    def free_kv(self, seqs) -> None:
        """Free kept sequences (those no longer held are skipped)."""
        with self._lock:
            for seq in seqs:
                if seq is not None and self._held.get(seq.seq_id) is seq:
                    del self._held[seq.seq_id]
                    self.cache.manager.free(seq)

    def release_kv_later(self, seqs) -> None:
        """`free_kv` from anywhere (a finaliser, another thread, inside a step): done before the next
        step or command. Takes no lock."""
        self._to_release.extend(seqs)

    def trim_kv(self, seq: KVSequence, num_tokens: int) -> bool:
        """Shorten a kept sequence to its first `num_tokens` tokens; returns whether it is still held
        (a sliding group that released what is needed frees it instead)."""
        with self._lock:
            if self._held.get(seq.seq_id) is not seq:
                return False
            if seq.num_tokens > num_tokens:
                try:
                    self.cache.manager.truncate(seq, seq.num_tokens - num_tokens)
                except ValueError:
                    del self._held[seq.seq_id]
                    self.cache.manager.free(seq)
                    return False
            return True

    def fork_kv(self, seq: KVSequence) -> KVSequence | None:
        """A second kept sequence sharing `seq`'s blocks (copy-on-write), or None if `seq` is not held."""
        with self._lock:
            if self._held.get(seq.seq_id) is not seq:
                return None
            fork = self.cache.fork_sequence(seq)
            self._held[fork.seq_id] = fork
            return fork

    def export_kv(self, seq: KVSequence) -> torch.Tensor:  # [seq.num_tokens * cache.kv_numel_per_token()]
        """The K/V of every token of a kept sequence, as one contiguous buffer (a copy: free `seq` when
        done). Disaggregated serving sends it to the engine that decodes (`import_kv`)."""
        with self._lock:
            if self._held.get(seq.seq_id) is not seq:
                raise ValueError("export_kv takes a sequence this engine keeps (kept_kv)")
            return self.cache.export_tokens(seq, seq.num_tokens)

    def import_kv(self, token_ids: SequenceABC[int], kv: torch.Tensor) -> KVSequence:
        """Store the K/V another engine serving the same model computed for `token_ids` (its `export_kv`
        buffer) in this engine's blocks, registering their prefix hashes, and keep the sequence: hand it
        to a request as `kv_prefix` (with `resume_tokens` for what that engine already generated), or
        `free_kv` it. Between steps only (the caller's thread steps this engine).

        Raises:
            ValueError: a buffer of the wrong size, or a cache that cannot move K/V; NoFreeBlocksError: a
                fixed pool without room. Nothing is stored then.
        """
        with self._lock:
            self._check_open()
            self._note_weights()  # salted with the current weights epoch, as a request admitted now would be
            seq = self.cache.import_tokens(list(token_ids), kv)
            self._held[seq.seq_id] = seq
            return seq

    def _evict_kept(self) -> bool:
        """Free every kept sequence (their owners recompute on use); returns whether any was held."""
        held, self._held = list(self._held.values()), {}
        for seq in held:
            self.cache.manager.free(seq)
        if held:
            logger.info("hf_paged: evicted %d kept sequences (returned caches) to make room", len(held))
        return bool(held)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._inbox)

    # ------------------------------------------------------------------ sizing (read-only, and one resize)
    @property
    def max_num_seqs(self) -> int:
        """Most requests running at once (`resize` raises it)."""
        return self.scheduler.max_num_seqs

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.cache.block_size

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the KV pool (`resize` grows it)."""
        return self.cache.pool.num_blocks

    @property
    def num_used_kv_blocks(self) -> int:
        """Blocks of the pool held by live sequences: running requests and kept K/V (`kept_kv`)."""
        return self.cache.pool.num_used_blocks

    def resize(self, max_num_seqs: int | None = None, max_model_len: int | None = None,
               num_blocks: int | None = None) -> None:
        """Raise the engine's limits to at least the given values, between steps; None leaves one as it
        is. Never shrinks anything: running requests and kept K/V may rely on the current limits, so a
        smaller value keeps the current one.

        Args:
            max_num_seqs: most requests running at once.
            max_model_len: longest sequence (prompt + output).
            num_blocks: blocks in the KV pool; growing allocates every layer's K/V for them.

        Raises:
            ValueError: a value that is not a positive integer (`max_model_len` at least 2); nothing
                changes then.
        """
        for name, value, low in (("max_num_seqs", max_num_seqs, 1), ("max_model_len", max_model_len, 2),
                                 ("num_blocks", num_blocks, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be an integer >= {low} or None, got {value!r}")
        with self._lock:  # not under a running step
            if max_num_seqs is not None:
                self.scheduler.max_num_seqs = max(self.scheduler.max_num_seqs, max_num_seqs)
            if max_model_len is not None:
                self.max_model_len = max(self.max_model_len, max_model_len)
            if num_blocks is not None:
                self.cache.grow_to(num_blocks)  # never shrinks

    def check_kv_transferable(self) -> None:
        """Raise ValueError unless this engine's K/V can move to another engine token by token
        (`export_kv` / `import_kv`: one KV group, unquantised, every layer's tensors allocated)."""
        self.cache.check_transferable()

    def kv_transfer_info(self) -> dict:
        """What a disaggregated worker reports of its KV pool: `num_blocks`, `free_blocks` (free or
        only cached, so reusable), `block_size`, `kv_numel_per_token` (elements of one token's K and V,
        `export_kv`'s buffer per token) and `kv_dtype` (the torch dtype K/V are stored and moved in).
        Needs every layer's tensors allocated (one forward)."""
        pool = self.cache.pool
        return {"num_blocks": pool.num_blocks, "free_blocks": pool.num_free_blocks + pool.num_cached_blocks,
                "block_size": self.cache.block_size, "kv_numel_per_token": self.cache.kv_numel_per_token(),
                "kv_dtype": self.cache.layers[0].keys.dtype}

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, as after a weight change the automatic detection cannot see
        (see `hf_paged.hf.weights`; `hf_paged.invalidate(model)` does the same for every cache of the
        model). Running requests keep their blocks but never share them again."""
        with self._lock:
            invalidate(self.model)
            self.cache.pool.reset_prefix_cache()
            self._note_weights()

    def _note_weights(self) -> None:
        """Check the weights before admitting: if they changed, the prefix cache is dropped and a new
        epoch begins; waiting requests that store nothing yet are salted with it (so they share the
        blocks they compute under the new weights with each other, and nothing older)."""
        self.cache.note_weights(weights_fingerprint(self.model))
        salt = self.cache.sequence_salt()
        for request in self.scheduler.waiting:
            if request.seq.num_tokens == 0:
                request.seq.extra_key = salt

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns the requests that produced a token or finished in it.

        A step either commits or leaves no trace. If it fails before its forward wrote the K/V, its
        requests go back to waiting (counted as preemptions), the exception propagates, and the next
        `step()` carries on (recomputing them). If one request fails after the forward, that request
        alone is rolled back and retried. A request failing `MAX_STEP_FAILURES` times, or one with NaN
        logits, ends with finish_reason "error" and its `.error`. `generate`, `stream`, handles and
        the background loop log step failures and keep going.

        Raises:
            EngineClosedError: the engine was shut down."""
        with self._lock:
            self._check_open()
            self._apply_inbox()
            began = time.perf_counter()
            failure = self._step()
            self._metrics.step_seconds += time.perf_counter() - began
            self._update_gauges()
            if failure is not None:
                raise failure  # what the step produced before failing comes with the next step
            updates, self._updates = self._updates, {}
            return [self._output(tracked) for tracked in updates.values()]

    def advance(self) -> None:
        """`step()` for callers that only need progress (the fronts, the loop): a failed step is
        already undone and logged, and the requests it concerned retry or end with an error."""
        try:
            self.step()
        except Exception:
            pass

    def _step(self) -> Exception | None:
        """One step; returns the exception that undid it, if any."""
        try:
            began = time.perf_counter()
            # Prefix-cache lookups happen only when admitting, and nothing is admitted while every slot
            # runs (the fingerprint reads a checksum from the device: no step pays for it in vain).
            if self.scheduler.waiting and len(self.scheduler.running) < self.scheduler.max_num_seqs:
                self._note_weights()
            if self.proposer is not None:
                self._propose()
            sched = self.scheduler.schedule()
            self._metrics.schedule_seconds += time.perf_counter() - began
            self._metrics.peak_kv_blocks = max(self._metrics.peak_kv_blocks, self.cache.pool.num_used_blocks)
            self._metrics.peak_num_running = max(self._metrics.peak_num_running, len(self.scheduler.running))
            for request in sched.preempted:
                self._note_preempted(self._requests[request.request_id])
            if sched.is_empty and self.scheduler.has_unfinished and (self._evict_kept()
                                                                     or self.scheduler.release_waiting()):
                # Returned caches, or waiting requests' handed-over prefixes, held the blocks the queue
                # needs: they are recomputed instead (mostly from the prefix cache).
                sched = self.scheduler.schedule()
            if sched.is_empty:
                if self.scheduler.has_unfinished:
                    raise RuntimeError(
                        "the scheduler could not schedule anything although requests are waiting "
                        f"(free blocks {self.cache.pool.num_free_blocks}/{self.cache.pool.num_blocks})"
                    )
                return None
            self._note_admissions(sched, time.perf_counter())
        except Exception as exc:  # scheduling or the bookkeeping around it
            self._on_failed_schedule(exc)
            return exc
        try:
            logits = self._forward(sched)
        except Exception as exc:
            self._requeue([e.request for e in sched.scheduled], exc, "forward")
            return exc
        self._consecutive_failed_steps = 0
        self._commit(sched, logits)
        return None

    def _num_logits(self, entry: ScheduledRequest) -> int:
        """Logits rows the entry needs: every position while its request wants prompt logprobs and the
        chunk holds prompt tokens, else its last 1 + drafts positions when it samples, else none."""
        if self._requests[entry.request.request_id].params.prompt_logprobs is not None and (
                entry.start < entry.request.num_prompt_tokens - 1):
            return len(entry.token_ids)
        return (1 + len(entry.draft_token_ids)) if entry.samples else 0

    def _forward(self, sched: SchedulerOutput) -> torch.Tensor:  # [num logit rows, vocab]
        chunks = [Chunk(e.request.seq, e.start, e.token_ids, e.group_slots, self._num_logits(e)) for e in sched.scheduled]
        began = time.perf_counter()
        logits = self.runner.forward(chunks, sched.copies, sched.new_full_blocks)
        self._metrics.forward_seconds += time.perf_counter() - began
        self._metrics.metadata_seconds += self.runner.last_metadata_seconds
        self._metrics.model_seconds += self.runner.last_model_seconds
        self._metrics.num_steps += 1
        num_tokens = sum(len(e.token_ids) for e in sched.scheduled)
        self._metrics.iteration_tokens.append(num_tokens)
        self._metrics.num_forward_tokens += num_tokens
        return logits

    def _commit(self, sched: SchedulerOutput, logits: torch.Tensor) -> None:
        """Turn the step's logits into tokens and commit them, one request at a time: a request that
        fails here is rolled back alone. Every sampling row of the step (each request's next position,
        each verified draft position, each of a request's n first samples) goes through one sampler
        call; if that call raises, each request is sampled alone."""
        plans, rows, index, row = [], [], [], 0
        for entry in sched.scheduled:
            n = self._num_logits(entry)
            if not n:
                continue
            tracked = self._requests[entry.request.request_id]
            first_sample = row + n - 1 - len(entry.draft_token_ids)
            num_rows = 0
            if entry.samples:
                group = tracked.group
                states = [tracked.state] + ([self._fork_state(tracked, j) for j in range(1, group.n)]
                                            if not group.forked else [])
                drafts = entry.draft_token_ids
                for j in range(len(drafts) + 1):
                    for state in states:
                        rows.append(SampleRow(state, tuple(drafts[:j])))
                        index.append(first_sample + j)
                        num_rows += 1
            plans.append((tracked, entry, row, n, len(rows) - num_rows, num_rows))
            row += n
        if not plans:
            return
        result = None
        began = time.perf_counter()
        try:
            if rows:
                # Every row at once, NaN rows included: the sampler flags them (their tokens are dropped
                # below) and reads the flags back with the tokens, the step's one wait for the device.
                result = self.sampler(self.sampler.take_rows(logits, index), rows, check_nan=True)
        except Exception:
            logger.warning("hf_paged: batched sampling failed; sampling each request alone", exc_info=True)
            self._metrics.num_failed_steps += 1
            result = None
        self._metrics.sampler_seconds += time.perf_counter() - began
        has_nan = self._nan_rows(logits, index, result)
        now = time.perf_counter()
        for tracked, entry, start, n, first_row, num_rows in plans:
            try:
                if any(has_nan[start:start + n]):
                    raise RequestError(f"the model produced NaN logits for request {tracked.public_id!r}")
                if tracked.params.prompt_logprobs is not None:
                    self._note_prompt_logprobs(tracked, entry, logits[start:start + n])
                if not entry.samples:
                    continue
                if result is not None:
                    out = result.slice(first_row, num_rows)
                else:
                    sub = rows[first_row:first_row + num_rows]
                    out = self.sampler(logits[index[first_row:first_row + num_rows]], sub)
                self._commit_sample(tracked, entry, out, now)
            except Exception as exc:
                self._roll_back(tracked, entry, exc)

    @staticmethod
    def _nan_rows(logits: torch.Tensor, index: list[int], result: SamplerOutput | None) -> list[bool]:
        """Per logits row, whether it holds a NaN: from the sampler's flags where it sampled the row; the
        rows it did not sample (prompt logprobs) or every row, if it failed, cost one more read."""
        has_nan = [False] * logits.shape[0]
        if result is not None:
            for k, row in enumerate(index):
                has_nan[row] = result.is_nan[k]
        unread = sorted(set(range(logits.shape[0])) - set(index)) if result is not None else range(logits.shape[0])
        if unread:
            for row, flag in zip(unread, torch.isnan(logits[list(unread)].amax(dim=-1)).tolist()):  # max propagates NaN
                has_nan[row] = flag
        return has_nan

    def _commit_sample(self, tracked: _Tracked, entry: ScheduledRequest, out: SamplerOutput, now: float) -> None:
        """Commit what the sampler drew for one entry: one token, or verified drafts plus one, or the
        first token of each of a request's n samples (which fork here)."""
        drafts = entry.draft_token_ids
        group = tracked.group
        if not group.forked:
            group.forked = True
            for j in range(1, group.n):  # each sample's own row j: its seed, the shared prompt logits
                self._fork_sample(tracked, j, out.slice(j, 1), now)
            out = out.slice(0, 1)
        if drafts:
            committed = verify_greedy(out.token_ids, drafts)
            self._metrics.on_verification(len(drafts), len(committed) - 1)
        else:
            committed = out.token_ids
        self._commit_tokens(tracked, committed, len(drafts), now, out)
    def _commit_tokens(self, tracked: _Tracked, tokens: list[int], num_drafts: int, now: float,
                       out: SamplerOutput) -> None:
        """Append `tokens` (cut at the first that ends the request), then roll the cache back past
        the rejected drafts. Everything that may raise (text, stop strings) runs before any change.
        `out` row j holds what the sampler returned with token j (logprobs, scores, logits)."""
        request, params = tracked.request, tracked.params
        num_out = request.num_output_tokens
        kept, reason = [], None
        for token in tokens:
            kept.append(token)
            reason = self._end_reason(params, num_out + len(kept), len(request.token_ids) + len(kept), token)
            if reason is not None:
                break
        deltas = []
        if tracked.detok is not None:
            for j, token in enumerate(kept):
                deltas.append(tracked.detok.add(token))
                if tracked.detok.stop_hit is not None:
                    kept, reason = kept[: j + 1], "stop"
                    break
            if reason is not None:
                deltas[-1] += tracked.detok.finish()
            if tracked.pending_text and deltas:
                deltas[0] = tracked.pending_text + deltas[0]
        # Committed from here on: nothing below raises for a well-formed request.
        events = [StreamEvent(tracked.public_id, tracked.index, token, delta, None, tracked.sample_index,
                              out.logprobs[j] if tracked.logprobs is not None else None)
                  for j, (token, delta) in enumerate(zip(kept, deltas or [None] * len(kept)))]
        if deltas:
            tracked.pending_text = ""
        for j, event in enumerate(events):
            request.token_ids.append(event.token_id)
            tracked.metrics.on_token(now)
            self._metrics.generation_tokens += 1
            if tracked.logprobs is not None:
                tracked.logprobs.append(out.logprobs[j])
            if tracked.scores is not None:
                tracked.scores.append(out.scores[j])
            if tracked.logits is not None:
                tracked.logits.append(out.logits[j])
        if tracked.inbox is not None:
            for event in events[:-1] if reason is not None else events:
                tracked.inbox.put(event, None)
        if reason is not None:
            self._finish(tracked, reason, last_event=events[-1])
            return
        rejected = num_drafts - (len(tokens) - 1)
        self.scheduler.rollback(request, rejected)
        self._updates[tracked.public_id] = tracked

    def _end_reason(self, params: SamplingParams, num_out: int, total: int, token: int) -> str | None:
        if num_out >= params.min_new_tokens and (
            token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        ):
            return "stop"
        if num_out >= params.max_new_tokens or total >= self.max_model_len:
            return "length"
        return None

    # ------------------------------------------------------------------ failures
    def _roll_back(self, tracked: _Tracked, entry: ScheduledRequest, exc: Exception) -> None:
        """Undo one request's share of a step whose forward succeeded: forget the tokens it computed
        in this step (its K/V stay valid for whoever shares them), rebuild its text state, and retry
        it, unless the failure is its own for good."""
        self._metrics.num_failed_steps += 1
        request = tracked.request
        if request.status == RequestStatus.RUNNING:
            self.scheduler.rollback(request, request.num_computed_tokens - entry.start)
        tracked.num_failures += 1
        fatal = isinstance(exc, RequestError) or tracked.num_failures >= MAX_STEP_FAILURES
        if not fatal and tracked.detok is not None:
            try:
                tracked.detok = self._replayed_detok(tracked)
            except Exception as replay_exc:  # its text state cannot be rebuilt: it cannot go on
                exc, fatal = replay_exc, True
        if fatal:
            self._fail(tracked, exc)
        else:
            logger.warning("hf_paged: request %r failed after the forward (%r); retrying it",
                           request.request_id, exc)

    def _replayed_detok(self, tracked: _Tracked) -> IncrementalDetokenizer:
        request = tracked.request
        detok = IncrementalDetokenizer(self.tokenizer, request.token_ids[: request.num_prompt_tokens],
                                       skip_special_tokens=tracked.params.skip_special_tokens,
                                       stop_strings=tracked.params.stop_strings)
        for token in tracked.output_ids:
            detok.add(token)
        return detok

    def _requeue(self, requests: list[Request], exc: Exception, stage: str) -> None:
        """The step raised before its K/V were complete: its requests go back to waiting (nothing of the
        step was published in the prefix cache) and are recomputed later."""
        self.cache.abandon_step(reset_prefix_cache=False)
        self._metrics.num_failed_steps += 1
        logger.warning("hf_paged: a step failed in %s (%r); requeueing its %d requests", stage, exc, len(requests))
        for request in requests:
            tracked = self._requests.get(request.request_id)
            if tracked is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.scheduler.preempt(request)
                self._note_preempted(tracked)
            tracked.num_failures += 1
            if tracked.num_failures >= MAX_STEP_FAILURES:
                self._fail(tracked, exc)

    def _on_failed_schedule(self, exc: Exception) -> None:
        """Scheduling (or the engine's own bookkeeping around it) raised: undo whatever it began."""
        self._consecutive_failed_steps += 1
        self._requeue(self.scheduler.recover(), exc, "scheduling")
        if self._consecutive_failed_steps >= MAX_STEP_FAILURES:  # nothing must hang silently
            logger.error("hf_paged: %d steps in a row failed; ending every unfinished request", MAX_STEP_FAILURES)
            for tracked in list(self._requests.values()):
                self._fail(tracked, exc)
            self._consecutive_failed_steps = 0

    def _note_preempted(self, tracked: _Tracked) -> None:
        tracked.metrics.num_preemptions += 1
        self._metrics.num_preemptions += 1
        if self.proposer is not None:
            self.proposer.free(tracked.request.request_id)

    def _fail(self, tracked: _Tracked, exc: Exception) -> None:
        tracked.error = exc
        self._finish(tracked, "error")

    # ------------------------------------------------------------------ speculative decoding
    def _num_drafts_for(self, tracked: _Tracked) -> int:
        request, params = tracked.request, tracked.params
        k = self.num_speculative_tokens if params.num_speculative_tokens is None else params.num_speculative_tokens
        # Never draft past what the request may still generate (the last token comes from the target).
        room = min(params.max_new_tokens - request.num_output_tokens, self.max_model_len - len(request.token_ids))
        return max(0, min(k, room - 1))

    def _propose(self) -> None:
        """Ask the proposer for drafts. If it raises, this step runs without any, and every request's
        draft state is dropped (the proposer starts afresh from the committed tokens)."""
        asks = []
        for request in self.scheduler.running:
            if request.num_pending_tokens != 1:
                continue  # still in prefill
            tracked = self._requests[request.request_id]
            if not tracked.group.forked:
                continue  # its first token is drawn once per sample from one row: no drafts
            k = self._num_drafts_for(tracked)
            if k > 0:
                asks.append(ProposalRequest(request.request_id, request.token_ids, k, tracked.state))
        if not asks:
            return
        try:
            proposals = self.proposer.propose(asks)
        except Exception:
            logger.warning("hf_paged: the draft proposer failed; this step runs without drafts", exc_info=True)
            self._metrics.num_failed_steps += 1
            for request in self.scheduler.running:
                self.proposer.free(request.request_id)
            return
        for ask, proposal in zip(asks, proposals):
            drafts = proposal.token_ids[: ask.num_tokens]
            valid = next((i for i, t in enumerate(drafts) if not 0 <= t < self.vocab_size), len(drafts))
            self._requests[ask.request_id].request.spec_token_ids = drafts[:valid]  # a draft vocab may be larger

    # ------------------------------------------------------------------ bookkeeping
    def _note_admissions(self, sched: SchedulerOutput, now: float) -> None:
        self._metrics.prefix_cache_queries += sched.num_prefix_query_tokens
        self._metrics.prefix_cache_hits += sched.num_prefix_hit_tokens
        for entry in sched.scheduled:
            tracked = self._requests[entry.request.request_id]
            request = entry.request
            if tracked.metrics.first_scheduled_time is None:
                tracked.metrics.first_scheduled_time = now
            tracked.metrics.num_cached_tokens = request.num_cached_tokens
            # Prompt tokens actually computed (outputs recomputed after a preemption count as prompt work).
            computed_prompt = max(0, min(entry.start + len(entry.token_ids), request.num_prompt_tokens) - entry.start)
            self._metrics.prompt_tokens += computed_prompt

    def _new_state(self, params: SamplingParams, seed: int, request: Request) -> SamplingState:
        end_ids = ([] if params.ignore_eos else list(self.eos_token_ids)) + list(params.stop_token_ids)
        return SamplingState(params, seed, request.token_ids, request.num_prompt_tokens, end_ids, self.eos_token_ids)

    # ------------------------------------------------------------------ n samples
    def _fork_state(self, tracked: _Tracked, j: int) -> SamplingState:
        """Sample j's state for its first draw, before it exists as a request (the prompt so far)."""
        return self._new_state(tracked.params, sample_seed(tracked.state.seed, j), tracked.request)

    def _fork_sample(self, parent: _Tracked, j: int, out: SamplerOutput, now: float) -> None:
        """Create sample j of `parent`'s request from its just computed prompt (sharing every block) and
        commit the first token drawn for it. If that commit fails, the sample alone is retried (it
        waits, to be recomputed) or ends with an error."""
        prompt = parent.request.token_ids[: parent.request.num_prompt_tokens]
        with self._registry_lock:
            request_id = f"{parent.public_id}#{j}"
            while request_id in self._requests or request_id in self._groups:
                request_id += "'"
            request = Request(request_id=request_id, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                              max_total_tokens=parent.request.max_total_tokens,
                              seq=self.cache.fork_sequence(parent.request.seq))
            metrics = RequestMetrics(arrival_time=parent.metrics.arrival_time, num_prompt_tokens=len(prompt))
            metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            detok = None
            if parent.detok is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt, skip_special_tokens=parent.params.skip_special_tokens,
                                               stop_strings=parent.params.stop_strings)
            seed = sample_seed(parent.state.seed, j)
            child = _Tracked(request, parent.params, metrics, detok, parent.inbox, parent.index,
                             self._new_state(parent.params, seed, request), parent.group, j)
            self._requests[request_id] = child
        self.scheduler.add_forked(request)
        if request.status != RequestStatus.RUNNING:
            return  # no room to run it now: it recomputes its prompt (from the prefix cache) and draws again
        try:
            self._commit_tokens(child, out.token_ids, 0, now, out)
        except Exception as exc:
            self._metrics.num_failed_steps += 1
            child.num_failures += 1
            if child.finish_reason is None:
                self.scheduler.preempt(request)
                self._note_preempted(child)
                if child.num_failures >= MAX_STEP_FAILURES:
                    self._fail(child, exc)

    def _note_prompt_logprobs(self, tracked: _Tracked, entry: ScheduledRequest, rows: torch.Tensor) -> None:
        """Prompt logprobs from a chunk's logits rows (one per position): position p predicts token p + 1."""
        request = tracked.request
        targets = [(j, entry.start + j + 1) for j in range(len(entry.token_ids))
                   if entry.start + j + 1 < request.num_prompt_tokens]
        if not targets:
            return
        found = logprobs_of(rows[[j for j, _ in targets]], [request.token_ids[t] for _, t in targets],
                            tracked.params.prompt_logprobs)
        for (_, t), entry_lp in zip(targets, found):
            tracked.group.prompt_logprobs[t] = entry_lp

    def _finish(self, tracked: _Tracked, reason: str, last_event: StreamEvent | None = None,
                report: bool = True) -> None:
        """End a request exactly once: free its blocks, settle its text, tell its owner (and, with
        `report`, the caller of `step()`)."""
        if tracked.finish_reason is not None:
            return
        tail = self._settle_text(tracked)  # may fail on its own; it then falls back, never raises
        kept = self.scheduler.finish(tracked.request, keep_kv=tracked.group.retain_kv and reason != "error")
        if kept is not None:
            self._keep(tracked, kept)
        if self.proposer is not None:
            self.proposer.free(tracked.request.request_id)
        tracked.finish_reason = reason
        tracked.metrics.finished_time = time.perf_counter()
        self._metrics.on_finished(tracked.metrics, reason)
        with self._registry_lock:
            del self._requests[tracked.request.request_id]
        group = tracked.group
        if not group.forked:  # it ended before its other samples existed: they end with it
            group.forked = True
            group.unforked_reason = reason
        output = self._output(tracked) if group.finished else None  # built once, by the last sample
        if group.finished:
            with self._registry_lock:
                self._groups.pop(group.request_id, None)
            if group.retain_kv:
                self._finished_groups[group.request_id] = group  # until `kept_kv` collects its sequences
        if report:
            self._updates[tracked.public_id] = tracked
        if tracked.inbox is not None:  # each sample's end event; the request's last one carries its output
            if last_event is None:
                text = tail if tracked.detok is not None else None
                last_event = StreamEvent(tracked.public_id, tracked.index, None, text, reason, tracked.sample_index)
            else:
                last_event.finish_reason = reason
                if tail:
                    last_event.text = (last_event.text or "") + tail
            tracked.inbox.put(last_event, output)

    def _settle_text(self, tracked: _Tracked) -> str:
        """Set the finished request's `.text`; returns the stream's last delta. If the incremental
        text fails now, the text is decoded whole instead (and the stream's tail is that remainder)."""
        if self.tokenizer is None:
            return ""
        if tracked.detok is not None:
            try:
                tail = tracked.detok.finish()
                tracked.text = tracked.detok.text
                return tail
            except Exception:
                logger.warning("hf_paged: detokenising request %r failed at its end; decoding it whole",
                               tracked.request.request_id, exc_info=True)
        try:
            text = self.tokenizer.decode(tracked.output_ids, skip_special_tokens=tracked.params.skip_special_tokens)
        except Exception:
            logger.warning("hf_paged: decoding request %r failed", tracked.request.request_id, exc_info=True)
            return ""
        shown = tracked.detok.text if tracked.detok is not None else ""
        tracked.text = text
        return text[len(shown):] if text.startswith(shown) else ""

    def _output(self, tracked: _Tracked) -> RequestOutput:
        """The request's output so far: every sample of it (text is set once a sample finishes;
        streams carry their own deltas)."""
        group = tracked.group
        first = group.members[0]
        outputs = []
        for j, m in enumerate(group.members):
            if m is None:  # never forked: the request ended first
                outputs.append(CompletionOutput(j, finish_reason=group.unforked_reason, error=first.error))
                continue
            outputs.append(CompletionOutput(
                index=j, token_ids=list(m.output_ids), text=m.text, finish_reason=m.finish_reason,
                logprobs=None if m.logprobs is None else list(m.logprobs),
                scores=None if m.scores is None else list(m.scores),
                logits=None if m.logits is None else list(m.logits), error=m.error))
        request = first.request
        prompt_logprobs = None
        if first.params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [group.prompt_logprobs.get(t) for t in range(1, request.num_prompt_tokens)]
        return RequestOutput(
            request_id=group.request_id,
            prompt_token_ids=request.token_ids[: request.num_prompt_tokens],
            outputs=outputs,
            prompt_logprobs=prompt_logprobs,
            metrics=first.metrics,
            finish_reason=outputs[0].finish_reason if group.finished else None,
        )

    def _update_gauges(self) -> None:
        m, pool = self._metrics, self.cache.pool
        m.num_requests_running = len(self.scheduler.running)
        m.num_requests_waiting = len(self.scheduler.waiting)
        m.kv_cache_usage_perc = pool.num_used_blocks / max(pool.num_blocks, 1)

    # ------------------------------------------------------------------ batch API
    def generate(
        self,
        prompts: str | SequenceABC[int] | SequenceABC[str | SequenceABC[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        *,
        column: str | None = None,
        kv_prefixes: SequenceABC[KVSequence | None] | None = None,
        retain_kv: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one `RequestOutput` per prompt, in input order.

        A prompt that is rejected (empty, too long, out-of-vocabulary ids, bad sampling params) gets an
        output with `finish_reason="error"` and `.error` set, and so does a request whose steps keep
        failing; the others still run and return their outputs. With `column`, `prompts` is a table
        (a `datasets.Dataset`, or a list of dicts) and each row's `column` is its prompt.
        `kv_prefixes` (one per prompt) and `retain_kv`: see `add_owned_request`; collect what was kept
        with `kept_kv(request_id)`.

        Raises:
            EngineClosedError: the engine was shut down.
        """
        self._check_open()
        if column is not None:
            names = getattr(prompts, "column_names", None)
            if names is not None and column not in names:
                raise ValueError(f"the dataset has no column {column!r} (it has {names})")
            try:
                prompts = list(prompts[column]) if names is not None else [row[column] for row in prompts]
            except (KeyError, TypeError) as exc:
                raise ValueError(f"column={column!r} needs a table whose every row has that column ({exc!r})") from exc
        prompts = as_prompt_list(prompts)
        params = as_params_list(sampling_params, len(prompts))
        prefixes = _prefix_list(kv_prefixes, len(prompts))
        inbox = Inbox(wants_tokens=False)
        results: dict[int, RequestOutput] = {}
        live: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                live[self.add_owned_request(prompt, p, None, inbox, i, kv_prefix=prefixes[i], retain_kv=retain_kv)] = i
            except (ValueError, TypeError) as exc:
                logger.warning("hf_paged: request %d rejected: %s", i, exc)
                prompt_ids = list(prompt) if not isinstance(prompt, str) else []
                n = p.n if isinstance(p, SamplingParams) and isinstance(p.n, int) and 0 < p.n <= 1024 else 1
                results[i] = RequestOutput(request_id=f"rejected-{i}", prompt_token_ids=prompt_ids,
                                           outputs=[CompletionOutput(j, finish_reason="error", error=exc)
                                                    for j in range(n)], finish_reason="error")
        bar = self._progress_bar(len(live), use_tqdm)
        try:
            for _, final in drain(inbox, len(live), self.advance, self.is_running):
                results[live[final.request_id]] = final
                if bar is not None:
                    bar.update(1)
        except BaseException:  # interrupted (KeyboardInterrupt...): stop what this call started
            for rid in live:
                self.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in range(len(prompts))]

    def stream(
        self,
        prompts: str | SequenceABC[int] | SequenceABC[str | SequenceABC[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        *,
        kv_prefixes: SequenceABC[KVSequence | None] | None = None,
        retain_kv: bool = False,
    ) -> Iterator[StreamEvent]:
        """Yield each token as it is produced, in order per request, for one prompt or many; each
        request's last event has its finish_reason. Another caller's `step()` (or the background
        loop) may produce them: they wait here until this iterator takes them.

        Invalid prompts raise before anything runs. Closing the iterator early aborts the requests
        it started (their blocks are freed). `kv_prefixes`, `retain_kv`: as for `generate`."""
        self._check_open()
        prompts = as_prompt_list(prompts)
        params = as_params_list(sampling_params, len(prompts))
        prefixes = _prefix_list(kv_prefixes, len(prompts))
        inbox = Inbox(wants_tokens=True)
        live: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                live.append(self.add_owned_request(prompt, p, None, inbox, i, streamed=True, kv_prefix=prefixes[i],
                                                   retain_kv=retain_kv))
            for event, _ in drain(inbox, len(live), self.advance, self.is_running):
                yield event
        finally:
            for rid in live:
                if rid in self._groups:
                    self.abort(rid)

    # ------------------------------------------------------------------ background loop
    def start(self) -> "Engine":
        """Run the step loop in a background thread, so that `submit` handles, `stream` and `generate`
        from any thread are served without driving steps themselves. Idempotent; returns self."""
        with self._lock:
            self._check_open()
            if self.is_running():
                return self
            self._stop_mode = None
            self._thread = threading.Thread(target=self._loop, name="hf_paged-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the background loop: after finishing every request (`drain=True`) or aborting them.

        Raises:
            TimeoutError: the loop did not end within `timeout` seconds (it keeps running).
        """
        thread = self._thread
        if thread is None:
            return
        self._stop_mode = "drain" if drain else "abort"
        self._wakeup.set()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"the engine loop did not stop within {timeout} s")
        self._thread = None

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop for good: finish (`drain`) or abort every request, stop the background loop, and free
        the sequences kept for callers. Every later call that would queue or run work (`add_request`,
        `submit`, `generate`, `stream`, `step`, `start`, `import_kv`) raises `EngineClosedError` at
        once. Idempotent.

        Raises:
            TimeoutError: the loop did not stop within `timeout` seconds (nothing is shut down).
        """
        if self._closed:
            return
        self.stop(drain, timeout)
        with self._lock:
            if drain:  # no loop ran them: step here until they end (a failing step ends them too)
                while self.has_unfinished_requests():
                    self._apply_inbox()
                    self.advance()
            self._closed = True
            self._apply_inbox()  # commands handed over as the loop stopped: queued requests end here
            for tracked in list(self._requests.values()):
                self._finish(tracked, "abort")
            self._evict_kept()
            groups, self._finished_groups = list(self._finished_groups.values()), {}
            self.free_kv(seq for group in groups for seq in group.kept)

    @property
    def is_closed(self) -> bool:
        """Whether `shutdown()` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this Engine was shut down (Engine.shutdown); create a new one")

    def is_running(self) -> bool:
        """Whether the background loop is running."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def _loop(self) -> None:
        try:
            self._run_loop()
        except BaseException as exc:
            logger.exception("hf_paged: the engine loop stopped")
            error = exc if isinstance(exc, Exception) else RuntimeError(f"the engine loop stopped: {exc!r}")
            with self._lock:  # nothing waits silently on a loop that is gone: every owner gets its end
                try:
                    self._apply_inbox()  # requests handed over as it died are queued first, then ended
                except Exception:  # noqa: BLE001 - what it could not apply is still ended below
                    logger.exception("hf_paged: applying the last commands failed")
                for tracked in list(self._requests.values()):
                    try:
                        self._fail(tracked, error)
                    except Exception:  # noqa: BLE001 - one request's end must not keep the others waiting
                        logger.exception("hf_paged: ending request %r failed", tracked.public_id)
            raise

    def _run_loop(self) -> None:
        while True:
            with self._lock:
                self._apply_inbox()
                if self._stop_mode == "abort":
                    for tracked in list(self._requests.values()):
                        self._finish(tracked, "abort")
                busy = self.scheduler.has_unfinished
                if not busy and self._stop_mode is not None:
                    return
                if busy:
                    self.advance()
            if not busy:
                self._wakeup.wait(0.05)
                self._wakeup.clear()
            else:
                time.sleep(0)  # let other threads take the lock between steps

    def _progress_bar(self, total: int, use_tqdm: bool | None):
        show = use_tqdm if use_tqdm is not None else self.show_progress
        if show is None:
            show = sys.stderr.isatty() and total > 1
        if not show:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="hf_paged", unit="req")

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict:
        """Engine-wide metrics keyed by vLLM's names (see `engine.metrics.EngineMetrics.as_dict`),
        plus the KV pool: `kv_block_size`, `kv_num_blocks`, `kv_bytes_per_block` and the peak in use
        (`kv_peak_blocks`, `kv_peak_bytes`)."""
        with self._lock:
            self._update_gauges()
            bytes_per_block = self.cache.bytes_per_block(next(self.model.parameters()).dtype)
            return {**self._metrics.as_dict(), "kv_block_size": self.cache.block_size,
                    "kv_num_blocks": self.cache.pool.num_blocks, "kv_bytes_per_block": bytes_per_block,
                    "kv_peak_blocks": self._metrics.peak_kv_blocks,
                    "kv_peak_bytes": self._metrics.peak_kv_blocks * bytes_per_block}

    def step_profile(self) -> dict:
        """Cumulative wall seconds since creation or `reset_metrics()`: in `step()`; of it, scheduling
        (drafting included), the forwards (of which building inputs and metadata, and the model call
        itself) and the sampler; the rest of a step is committing its tokens. Also the steps and the
        tokens fed to the forwards. Cheap enough to read after every step."""
        m = self._metrics
        return dict(step_seconds=m.step_seconds, schedule_seconds=m.schedule_seconds,
                    forward_seconds=m.forward_seconds, metadata_seconds=m.metadata_seconds,
                    model_seconds=m.model_seconds, sampler_seconds=m.sampler_seconds,
                    num_steps=m.num_steps, num_forward_tokens=m.num_forward_tokens)

    def metrics_summary(self) -> str:
        with self._lock:
            self._update_gauges()
            return self._metrics.summary()

    def reset_metrics(self) -> None:
        with self._lock:
            self._metrics.reset()


def _prefix_list(kv_prefixes, num_prompts: int) -> list:
    if kv_prefixes is None:
        return [None] * num_prompts
    kv_prefixes = list(kv_prefixes)
    if len(kv_prefixes) != num_prompts:
        raise ValueError(f"kv_prefixes has {len(kv_prefixes)} entries for {num_prompts} prompts")
    return kv_prefixes
