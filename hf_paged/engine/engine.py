"""`Engine`: continuous batching over a transformers model with a paged KV cache: the public front.

    engine = hf_paged.Engine(model, tokenizer)
    outputs = engine.generate(["Hello!", "Tell me a joke."], hf_paged.SamplingParams(max_new_tokens=64))
    for out in engine.stream("Once upon a time", hf_paged.SamplingParams(max_new_tokens=32)):
        print(out.text, end="")

It is composed of

    EngineCore (core.py)        schedule -> execute -> sample -> update, one step at a time
      Executor (executor.py)    one packed forward [1, num_tokens] per step (in this process today)
      KVOwner (hf.kv_owner)     the blocks: the step transaction, kept sequences, K/V transfer
    OutputProcessor             text, stop strings, streaming events, `RequestOutput`s

and owns what a front needs besides: request intake and its checks (`inputs.py`), threads (commands
from other threads reach a running loop through an inbox; one lock is held for a whole step),
blocking `generate` / `stream`, the background loop, shutdown and the kept-KV API. Requests join
and leave at every step; long prompts are chunked; when blocks run out the newest request is
preempted and later recomputed (mostly from the prefix cache).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence as SequenceABC
from dataclasses import replace

import torch

from ..attention import ATTN_IMPLEMENTATION
from ..config import (DEFAULT_GRAMMAR_CACHE_BYTES, DEFAULT_GRAMMAR_COMPILE_TIMEOUT_SECONDS,
                      DEFAULT_GRAMMAR_MASK_BUDGET_SECONDS, EngineConfig, PagedCacheConfig,
                      default_max_state_checkpoints)
from ..core import KVSequence, Scheduler
from ..hf import PagedCache, check_attention_routed, check_model_supported, invalidate, weights_fingerprint
from ..hf.rope import default_max_model_len
from ..sampling_params import SamplingParams
from ..spec_decode import make_proposer
from ..worker import ModelRunner
from ..worker.cpu_graphs import batch_buckets as cpu_batch_buckets
from ..worker.cpu_graphs import check_cpu_graphs
from ..worker.cuda_graphs import batch_size_buckets, check_cuda_graphs, max_seqlen_buckets
from .core import MAX_STEP_FAILURES, EngineCore, RequestError
from .delivery import Inbox, RequestHandle
from .blocking import BlockingAPI
from .executor import InProcessExecutor
from .inputs import as_token_id_list, model_eos_token_ids
from .intake import Intake
from .kept_kv import KeptKVAPI
from .kv_budget import default_num_blocks
from .loop import StepLoop
from .output_processor import OutputProcessor
from .tensor_parallel import (Follower, Lead, TensorParallelCalls, TensorParallelExecutor, check_tensor_parallel,
                              tensor_parallel_group)
from .outputs import RequestOutput

logger = logging.getLogger(__name__)

__all__ = ["MAX_STEP_FAILURES", "Engine", "EngineClosedError", "RequestError"]


class EngineClosedError(RuntimeError):
    """A call on an engine that can no longer serve it: shut down (`Engine.shutdown`), or, for
    `AsyncEngine`, one whose background loop is not running."""



class Engine(TensorParallelCalls, BlockingAPI, KeptKVAPI):
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
        cache_salt, attention_backend: see `PagedCacheConfig` (`kv_cache_dtype` takes the names of
            `config.KV_CACHE_DTYPES`; a quantised cache honours a checkpoint's own `k_scale` / `v_scale`).
        num_blocks: fixed KV pool size in blocks. Default: from `max_kv_bytes`.
        max_kv_bytes: KV budget in bytes (default: 2 GiB on CPU, half the free memory on CUDA, capped).
        max_model_len: longest sequence (prompt + output); default the model's max positions.
        show_progress: tqdm bar in `generate`; None = only when stderr is a terminal.
        draft_model: a smaller causal LM sharing the tokenizer, or a Gemma 4 assistant: speculative decoding.
        speculative_method: "draft_model" (implied by `draft_model`), "ngram" (prompt lookup) or None.
        num_speculative_tokens: tokens drafted per step and request (default 5 when speculating, at most
            `config.MAX_SPECULATIVE_TOKENS`); `SamplingParams.num_speculative_tokens` overrides it (0 = off).
        prompt_lookup_min, prompt_lookup_max: n-gram sizes the "ngram" proposer tries.
        eos_token_ids: end-of-sequence ids; default the model's generation config's (its config's, the tokenizer's).
        cuda_graphs: replay decode steps from CUDA graphs per (batch, max_seqlen_k) bucket (`worker/cuda_graphs.py`);
            None (default): on for a CUDA model with the Triton backend; True where they cannot run: ValueError.
        cpu_graphs: on CPU, run decode steps compiled by Inductor per batch bucket (`worker/cpu_graphs.py`); None
            (default): `config.EngineConfig.cpu_graphs`; True compiles when a step first needs it.
        cuda_graph_batch_sizes, cuda_graph_max_seqlens: the buckets of either (default 1, 2, 4, ... `max_num_seqs`,
            on CPU up to 8; 256, 512, ... the longest sequence the pool allows); a step past the largest runs eagerly.
        state_checkpoint_interval, max_state_checkpoints: a model with recurrent layers (`hf.state`): tokens
            between the state checkpoints its prefix cache keeps (default `block_size`), and how many at most.
        grammar_cache_bytes, grammar_compile_timeout_seconds, grammar_mask_budget_seconds: structured outputs'
            limits (`config.DEFAULT_GRAMMAR_*`; `structured.grammar.Grammars`): compiled grammars kept (bytes); how
            long a request waits for its grammar to compile; how long its token masks may take per step, or it
            ends with an error. A time of None: no limit.
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
        attention_backend: str | None = EngineConfig.attention_backend,
        max_model_len: int | None = EngineConfig.max_model_len,
        state_checkpoint_interval: int | None = EngineConfig.state_checkpoint_interval,
        max_state_checkpoints: int | None = EngineConfig.max_state_checkpoints,
        show_progress: bool | None = None,
        draft_model: torch.nn.Module | None = None,
        speculative_method: str | None = EngineConfig.speculative_method,
        num_speculative_tokens: int | None = EngineConfig.num_speculative_tokens,
        prompt_lookup_min: int = EngineConfig.prompt_lookup_min,
        prompt_lookup_max: int = EngineConfig.prompt_lookup_max,
        eos_token_ids: int | SequenceABC[int] | None = None,
        cuda_graphs: bool | None = EngineConfig.cuda_graphs,
        cpu_graphs: bool | None = EngineConfig.cpu_graphs,
        cuda_graph_batch_sizes: SequenceABC[int] | None = EngineConfig.cuda_graph_batch_sizes,
        cuda_graph_max_seqlens: SequenceABC[int] | None = EngineConfig.cuda_graph_max_seqlens,
        grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
        grammar_compile_timeout_seconds: float | None = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_SECONDS,
        grammar_mask_budget_seconds: float | None = DEFAULT_GRAMMAR_MASK_BUDGET_SECONDS,
    ):
        check_model_supported(model.config)
        check_attention_routed(model)  # every decoder layer calls the "hf_paged" function with the step
        Scheduler.check_limits(max_num_seqs, max_num_batched_tokens)
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.tokenizer = tokenizer
        text = model.config.get_text_config(decoder=True)
        model_len = max_model_len or default_max_model_len(text) or 1 << 30
        # Held while encoding (prompts here, chat templates in the server): a fast tokenizer whose
        # settings change on an encode (truncation, padding) must not be written from two threads.
        self.tokenizer_lock = threading.Lock()
        if not isinstance(model_len, int) or model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.device = next(model.parameters()).device
        self.show_progress = show_progress
        probe = PagedCacheConfig(  # validates the knobs before any sizing
            block_size=block_size, num_blocks=num_blocks, max_kv_bytes=max_kv_bytes, kv_cache_dtype=kv_cache_dtype,
            kv_quant_scheme=kv_quant_scheme, kv_quant_rotation=kv_quant_rotation,
            enable_prefix_caching=enable_prefix_caching, enable_hybrid_kv=enable_hybrid_kv, cache_salt=cache_salt,
            attention_backend=attention_backend)
        # A tensor-parallel model: rank 0 runs the engine, the other ranks follow (`tensor_parallel.py`).
        self.tensor_parallel = tp = tensor_parallel_group(model)
        probe = check_tensor_parallel(tp, probe, draft_model, speculative_method)
        states = _state_plan(state_checkpoint_interval, max_state_checkpoints, block_size, max_num_seqs,
                             enable_prefix_caching)
        num_blocks = num_blocks or default_num_blocks(model, probe, max_num_seqs, model_len, self.device, states[0])
        if tp is not None:
            num_blocks = tp.broadcast(num_blocks)  # rank 0's pool: every rank holds the same block ids
        cache_config = replace(probe, max_kv_bytes=None, num_blocks=num_blocks)
        kv = PagedCache(model.config, cache_config).kv  # the model's layers write through the adapter
        if kv.states is not None:  # recurrent layers: rows for the running sequences, their snapshots, checkpoints
            kv.configure_states(*states)
        kv.use_checkpoint_kv_scales(model)
        eos_token_ids = (model_eos_token_ids(model, tokenizer) if eos_token_ids is None
                         else as_token_id_list(eos_token_ids))
        runner = ModelRunner(model, kv)
        longest = min(model_len, kv.num_blocks * kv.block_size)
        _enable_decode_graphs(runner, cuda_graphs and tp is None, cpu_graphs if tp is None else False, attention_backend,
                              max_num_seqs, cuda_graph_batch_sizes, max_seqlen_buckets(longest, cuda_graph_max_seqlens))
        proposer, num_speculative_tokens = make_proposer(
            draft_model=draft_model, method=speculative_method, num_tokens=num_speculative_tokens,
            lookup_min=prompt_lookup_min, lookup_max=prompt_lookup_max, target_num_blocks=kv.num_blocks,
            max_num_seqs=max_num_seqs, block_size=kv.block_size, kv_cache_config=cache_config,
            target_model=model, target_kv=kv)
        if getattr(proposer, "needs_hidden_states", False):  # a Gemma 4 assistant drafts from them
            runner.keep_hidden_states()
        self.outputs = OutputProcessor(tokenizer)
        self.core = EngineCore(
            Scheduler(kv.manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
            TensorParallelExecutor(runner, tp) if tp is not None else InProcessExecutor(runner), kv, self.outputs,
            proposer=proposer,
            num_speculative_tokens=num_speculative_tokens, eos_token_ids=eos_token_ids,
            max_model_len=model_len, vocab_size=self.vocab_size,
            fingerprint=lambda: weights_fingerprint(model))
        self.kv = kv
        self._metrics = self.core.metrics
        self.intake = Intake(self.core, kv, self.outputs, tokenizer, self.tokenizer_lock, self.vocab_size,
                             runner.image_support, logits_width=getattr(text, "vocab_size", None),
                             length_rope=runner.length_rope, grammar_cache_bytes=grammar_cache_bytes,
                             grammar_compile_timeout_seconds=grammar_compile_timeout_seconds,
                             grammar_mask_budget_seconds=grammar_mask_budget_seconds)
        # Threads: `_lock` guards all engine state and is held for a whole step, so nothing changes
        # under a running forward. Other threads hand work to a running loop through `_inbox`.
        self._lock = threading.RLock()
        self._inbox: deque[tuple] = deque()
        self.loop = StepLoop(self._lock, self._loop_turn, self._loop_died)
        self._closed = False  # `shutdown()`: every later call raises EngineClosedError
        self._follower = Follower(runner, tp) if tp is not None and not tp.leads else None
        self._lead = Lead(tp) if tp is not None and tp.leads else None

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | SequenceABC[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request and return its id. Its outputs come back from `step()`.

        Args:
            prompt: a string (needs a tokenizer) or a list of token ids; or, for a vision-language
                model, vLLM's dict `{"prompt" or "prompt_token_ids": ..., "multi_modal_data": {...}}`
                whose `multi_modal_data` is the processor's image tensors for this prompt
                (`pixel_values` and, where the model takes them, `image_sizes`, `image_grid_thw`).
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
                          resume_tokens: SequenceABC[int] = (), compiled_grammar=None) -> str:
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
            compiled_grammar: the request's `structured` constraint, compiled (`intake.compile_grammar`).
        """
        self._check_open()
        tracked = self.intake.track(prompt, sampling_params, request_id, inbox, index, streamed, kv_prefix,
                                    retain_kv, resume_tokens, compiled_grammar)
        self._post(("add", tracked))
        return tracked.public_id

    @property
    def image_token_id(self) -> int | None:
        """The model's image placeholder id (None for a text-only model)."""
        return self.runner.image_support.token_id

    def image_token_counts(self, images) -> list[int]:
        """How many placeholder tokens each image fills (its feature rows), for `images`: a prompt's
        `multi_modal_data`, or its images already split (`hf.multimodal.ImageSupport.split`). Runs the
        encoder on the images it has not cached (between steps), which then serves their requests.

        Raises:
            ValueError/TypeError: the data is malformed, or the engine cannot serve this model's images."""
        self._check_open()
        items = images if isinstance(images, list) else self.runner.image_support.split(images)
        with self._lock:
            features, num_encoded = self.core.executor.encode_images(items)
            self._metrics.mm_encoder_runs += num_encoded
        return [f.shape[0] for f in features]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its output so far (None if unknown).

        Safe from any thread: it takes effect between steps, never under a running forward."""
        box: list = []
        self._post(("abort", request_id, box))
        return box[0] if box else None

    def _post(self, command: tuple) -> None:
        """Apply `command` now if no step is running, else hand it to the running loop."""
        if self.is_running() and not self.loop.is_loop_thread():
            done = threading.Event()
            self._inbox.append((*command, done))
            self.loop.wake()
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
        self.kv.apply_releases()
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
                    self.kv.free([prefix])
                self.core.fail(tracked, EngineClosedError("the engine was shut down before this request was queued"))
                return
            self.core.add(tracked)
        elif command[0] == "abort":
            output = self.core.abort(command[1])
            if output is not None:
                command[2].append(output)

    def has_unfinished_requests(self) -> bool:
        return self.core.scheduler.has_unfinished or bool(self._inbox)

    # ------------------------------------------------------------------ sizing (read-only, and one resize)
    @property
    def max_num_seqs(self) -> int:
        """Most requests running at once (`resize` raises it)."""
        return self.core.scheduler.max_num_seqs

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.kv.block_size

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the KV pool (`resize` grows it)."""
        return self.kv.num_blocks

    @property
    def num_used_kv_blocks(self) -> int:
        """Blocks of the pool held by live sequences: running requests and kept K/V (`kept_kv`)."""
        return self.kv.num_used_blocks

    def resize(self, max_num_seqs: int | None = None, max_model_len: int | None = None,
               num_blocks: int | None = None) -> None:
        """Raise the engine's limits to at least the given values, between steps; None leaves one as it
        is. Never shrinks anything: running requests and kept K/V may rely on the current limits.

        Raises:
            ValueError: a value that is not a positive integer (`max_model_len` at least 2); nothing
                changes then.
        """
        for name, value, low in (("max_num_seqs", max_num_seqs, 1), ("max_model_len", max_model_len, 2),
                                 ("num_blocks", num_blocks, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be an integer >= {low} or None, got {value!r}")
        with self._lock:  # not under a running step
            self.core.raise_limits(max_num_seqs, max_model_len)
            if num_blocks is not None:
                self.kv.grow_to(num_blocks)  # never shrinks

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, as after a weight change the automatic detection cannot see
        (see `hf_paged.hf.weights`; `hf_paged.invalidate(model)` does the same for every cache of the
        model). Running requests keep their blocks but never share them again."""
        with self._lock:
            invalidate(self.model)
            self.kv.reset_prefix_cache()
            self.core.note_weights()

    # ------------------------------------------------------------------ the parts, read-only
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def cache(self) -> PagedCache:
        return self.kv.cache

    @property
    def runner(self) -> ModelRunner:
        return self.core.executor.runner

    @property
    def proposer(self):
        return self.core.drafter.proposer

    @property
    def sampler(self):
        return self.core.sampler

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) a request may reach."""
        return self.core.max_model_len

    @max_model_len.setter
    def max_model_len(self, value: int) -> None:
        self.core.max_model_len = value

    @property
    def eos_token_ids(self) -> list[int]:
        return self.core.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        """For requests added from now on (their end ids are fixed when they are added)."""
        self.core.eos_token_ids = as_token_id_list(ids)

    @property
    def num_speculative_tokens(self) -> int:
        return self.core.drafter.num_speculative_tokens

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
            try:
                updated = self.core.step()  # what a failed step produced comes with the next step
            finally:
                self._metrics.step_seconds += time.perf_counter() - began
                self.core.update_gauges()
            return [self.outputs.output(tracked) for tracked in updated]

    def advance(self) -> None:
        """`step()` for callers that only need progress (the fronts, the loop): a failed step is
        already undone and logged, and the requests it concerned retry or end with an error."""
        try:
            self.step()
        except Exception:
            pass

    # ------------------------------------------------------------------ background loop
    def start(self) -> "Engine":
        """Run the step loop in a background thread, so that `submit` handles, `stream` and `generate`
        from any thread are served without driving steps themselves. Idempotent; returns self."""
        with self._lock:
            self._check_open()
            self.loop.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the background loop: after finishing every request (`drain=True`) or aborting them.

        Raises:
            TimeoutError: the loop did not end within `timeout` seconds (it keeps running).
        """
        self.loop.stop(drain, timeout)

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
            self.core.end_all("abort")
            self.kv.evict_kept()
            self.kv.free(self.core.drop_finished_groups())
            self._stop_followers()

    @property
    def is_closed(self) -> bool:
        """Whether `shutdown()` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this Engine was shut down (Engine.shutdown); create a new one")

    def is_running(self) -> bool:
        """Whether the background loop is running."""
        return self.loop.is_running()

    def _loop_turn(self, stop_mode: str | None) -> bool:
        """One turn of the background loop (under the lock): returns whether requests remain."""
        self._apply_inbox()
        if stop_mode == "abort":
            self.core.end_all("abort")
        busy = self.core.scheduler.has_unfinished
        if busy:
            self.advance()
        return busy

    def _loop_died(self, error: Exception) -> None:
        """Every owner gets its end: requests handed over as the loop died are queued first, then ended."""
        try:
            self._apply_inbox()
        except Exception:  # noqa: BLE001 - what it could not apply is still ended below
            logger.exception("hf_paged: applying the last commands failed")
        self.core.end_all("error", error)  # one request's end never keeps the others waiting

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict:
        """Engine-wide metrics keyed by vLLM's names (see `engine.metrics.EngineMetrics.as_dict`),
        plus the KV pool: `kv_block_size`, `kv_num_blocks`, `kv_bytes_per_block` and the peak in use
        (`kv_peak_blocks`, `kv_peak_bytes`)."""
        with self._lock:
            self.core.update_gauges()
            bytes_per_block = self.kv.bytes_per_block(next(self.model.parameters()).dtype)
            return {**self._metrics.as_dict(), "kv_block_size": self.kv.block_size,
                    "kv_num_blocks": self.kv.num_blocks, "kv_bytes_per_block": bytes_per_block,
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
            self.core.update_gauges()
            return self._metrics.summary()

    def reset_metrics(self) -> None:
        with self._lock:
            self._metrics.reset()


def _enable_decode_graphs(runner: ModelRunner, cuda_graphs: bool | None, cpu_graphs: bool | None,
                          attention_backend: str | None, max_num_seqs: int, batch_sizes: SequenceABC[int] | None,
                          max_seqlens: tuple[int, ...]) -> None:
    """Give the runner CUDA graphs or compiled CPU steps for decode steps, as the Engine's arguments ask
    (`batch_sizes`: the caller's batch buckets, None: each kind's default)."""
    cuda_buckets = batch_size_buckets(max_num_seqs, batch_sizes)  # validates the caller's sizes either way
    if check_cuda_graphs(cuda_graphs, runner.model, runner.device, attention_backend):
        runner.enable_cuda_graphs(cuda_buckets, max_seqlens)
    elif (compile_after := check_cpu_graphs(cpu_graphs, runner.model, runner.device)) is not None:
        runner.enable_cpu_graphs(cpu_batch_buckets(max_num_seqs, batch_sizes), max_seqlens, after_steps=compile_after)


def _state_plan(interval: int | None, checkpoints: int | None, block_size: int, max_num_seqs: int,
                prefix_caching: bool) -> tuple[int, int, int]:
    """(rows, checkpoints, interval) of a model with recurrent layers (`KVOwner.configure_states`): a
    state row per running sequence and the prefix-cache checkpoints (none without prefix caching), the
    knobs' defaults filled in. Speculative snapshots (a row per draft of a verifying sequence) are taken
    as they come: the rows grow for them."""
    for name, value, low in (("state_checkpoint_interval", interval, 1), ("max_state_checkpoints", checkpoints, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"{name} must be an integer >= {low} or None, got {value!r}")
    interval = block_size if interval is None else interval  # a multiple of it (`KVOwner.configure_states`)
    checkpoints = default_max_state_checkpoints(max_num_seqs) if checkpoints is None else checkpoints
    checkpoints = checkpoints if prefix_caching else 0
    return max_num_seqs + checkpoints + 1, checkpoints, interval
