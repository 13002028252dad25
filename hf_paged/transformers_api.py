"""The transformers internals hf_paged relies on, in one place, and the releases they were checked on.

hf_paged plugs into transformers through its public extension points where they exist
(`AttentionInterface`, `AttentionMaskInterface`, `Cache` / `CacheLayerMixin` subclasses). Where none
exists, the drop-in patch wraps or calls a private method, reads a private attribute, or mirrors
what a private method does. Every such name is listed here (`PRIVATE_API`): the module and name, the
parameters hf_paged passes or receives by name, what uses it, and how (`wrapped`: replaced by
hf_paged's own wrapper, which forwards the parameters listed; `called`: called with them; `read`: an
attribute read; `mirrored`: re-implemented to return what it returns, parity-tested).

`problems()` resolves every entry in the installed transformers and says, per entry, what no longer
matches. `integrations.install()` leaves transformers unpatched (stock `generate` serves every call,
one warning naming each problem) when anything is off, and `tests/test_transformers_api.py` fails
with the same message: a renamed parameter is one named failure, not a `TypeError` deep inside a
user's call.

A release outside `SUPPORTED_TRANSFORMERS` is not patched unless `HF_PAGED_ALLOW_UNTESTED_TRANSFORMERS=1`
(what `scripts/check_transformers.sh` sets to try the next release).

A leaf: it imports nothing of hf_paged, and transformers only inside its functions.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os

# The supported range [low, high): pyproject.toml declares the same (tests/test_transformers_api.py checks it).
SUPPORTED_TRANSFORMERS = ("5.22.0", "5.26.0")
# The releases the whole list below was resolved and signature-checked on (`scripts/check_transformers.sh`).
CHECKED_ON = ("5.22.0", "5.23.0", "5.24.0", "5.25.0")
ALLOW_UNTESTED_ENV = "HF_PAGED_ALLOW_UNTESTED_TRANSFORMERS"
# transformers' own switch for hub kernels (on by default from 5.25; `from_pretrained(use_kernels=)` per call).
HUB_KERNELS_ENV = "USE_HUB_KERNELS"


@dataclasses.dataclass(frozen=True)
class PrivateAPI:
    """One transformers internal hf_paged relies on.

    Args:
        module: the module that defines it ("transformers.generation.utils").
        name: its dotted name inside the module ("GenerationMixin._prepare_cache_for_generation").
        how: "wrapped", "called", "read" or "mirrored" (see the module docstring).
        used_by: the hf_paged module(s) that rely on it.
        positional: the leading parameters (after `self` / `cls`), in order, that hf_paged passes
            positionally or receives positionally in its wrapper.
        keywords: parameters hf_paged passes or reads by name (any position).
        mentions: for an attribute transformers sets at run time (on a cache, on a model): a string its
            source (`name`'s) must contain, the assignment hf_paged relies on.
        optional: the module belongs to a package transformers runs without (`kernels`): not installed
            is no problem, installed must match.
    """

    module: str
    name: str
    how: str
    used_by: str
    positional: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    mentions: str | None = None
    optional: bool = False  # a package transformers may run without: absent is fine, present must match

    @property
    def qualified(self) -> str:
        return ".".join(filter(None, (self.module, self.name)))


_GEN = "transformers.generation.utils"
_MODELING = "transformers.modeling_utils"

PRIVATE_API: tuple[PrivateAPI, ...] = (
    # ---- generation: the drop-in patch (integrations.generate and the modules it installs)
    PrivateAPI(_GEN, "GenerationMixin.generate", "wrapped", "integrations.generate",
               positional=("inputs", "generation_config")),
    PrivateAPI(_GEN, "GenerationMixin._prepare_cache_for_generation", "wrapped", "integrations.generate",
               positional=("generation_config", "model_kwargs")),
    PrivateAPI(_GEN, "GenerationMixin._prepare_generation_config", "called", "integrations.generation_config",
               positional=("generation_config",)),
    PrivateAPI(_GEN, "GenerationMixin._prepare_generated_length", "called", "integrations.generation_config",
               keywords=("generation_config", "has_default_max_length", "has_default_min_length",
                         "model_input_name", "input_ids_length", "inputs_tensor")),
    PrivateAPI(_GEN, "GenerationMixin._prepare_special_tokens", "called",
               "integrations.stock_scores, integrations.batch_generate",
               positional=("generation_config", "kwargs_has_attention_mask"), keywords=("device",)),
    PrivateAPI(_GEN, "GenerationMixin._get_logits_processor", "called", "integrations.stock_scores",
               keywords=("generation_config", "input_ids_seq_length", "encoder_input_ids", "prefix_allowed_tokens_fn",
                         "logits_processor", "device", "model_kwargs")),
    PrivateAPI(_GEN, "GenerationMixin._get_stopping_criteria", "called", "integrations.batch_generate",
               keywords=("generation_config", "stopping_criteria", "tokenizer")),
    PrivateAPI(_GEN, "GenerationMixin._prepare_attention_mask_for_generation", "mirrored",
               "integrations.batch_generate (_inferred_attention_mask)",
               positional=("inputs_tensor", "generation_config", "model_kwargs")),
    PrivateAPI(_GEN, "GenerationMixin._prepare_multimodal_encoder_kwargs_for_generation", "mirrored",
               "hf.multimodal", positional=("model_kwargs",)),
    PrivateAPI(_GEN, "GenerationMixin._expand_multimodal_outputs", "mirrored", "hf.multimodal",
               positional=("input_ids", "mm_encoder_output", "expand_size")),
    PrivateAPI(_GEN, "GenerationMixin._prepare_cache_for_generation", "read", "integrations.generate",
               mentions="_is_user_defined"),  # the flag generate sets on a cache the caller passed
    PrivateAPI("transformers.pipelines.text_generation", "TextGenerationPipeline.get_iterator", "wrapped",
               "integrations.pipeline", positional=("inputs", "num_workers", "batch_size", "preprocess_params",
                                                    "forward_params", "postprocess_params")),
    PrivateAPI("transformers.pipelines.pt_utils", "PipelineIterator.__init__", "read", "integrations.pipeline",
               positional=("loader", "infer", "params")),  # the iterator's attributes of the same names
    PrivateAPI("transformers.generation.continuous_batching.continuous_api", "ContinuousMixin.generate_batch",
               "wrapped", "integrations.generate_batch",
               positional=("inputs", "generation_config", "continuous_batching_config", "record_timestamps",
                           "progress_bar", "persistent_manager", "warmup")),
    PrivateAPI("transformers.generation.continuous_batching.requests", "GenerationOutput", "called",
               "integrations.generate_batch",
               keywords=("request_id", "prompt_ids", "generated_tokens", "logprobs", "error", "status",
                         "created_time", "lifespan")),
    PrivateAPI("transformers.generation.continuous_batching.requests", "RequestStatus.FINISHED", "read",
               "integrations.generate_batch"),
    PrivateAPI("transformers.generation.continuous_batching.requests", "RequestStatus.FAILED", "read",
               "integrations.generate_batch"),
    # ---- loading: the load-time refusal (integrations.load_check) and the support checks (hf.support)
    PrivateAPI(_MODELING, "PreTrainedModel.get_correct_attn_implementation", "wrapped", "integrations.load_check",
               positional=("requested_attention", "is_init_check")),
    PrivateAPI(_MODELING, "PreTrainedModel._from_config", "wrapped", "integrations.load_check",
               positional=("config",)),
    PrivateAPI(_MODELING, "PreTrainedModel._supports_attention_backend", "read", "hf.support"),
    # Where a class does not declare the flag above, hf.support reads its modelling module's source for
    # attention modules that call what this table gives (by this name) with their **kwargs. A module
    # written otherwise is refused as before, never admitted by mistake.
    PrivateAPI(_MODELING, "ALL_ATTENTION_FUNCTIONS", "read", "hf.support (routes_attention)"),
    PrivateAPI(_MODELING, "PreTrainedModel._supports_sdpa", "read", "hf.support, integrations.generate"),
    PrivateAPI("transformers.configuration_utils", "PreTrainedConfig._attn_implementation", "read",
               "engine, integrations, spec_decode, hf.planning"),
    PrivateAPI("transformers.distributed.mixin", "", "read", "engine.tensor_parallel",
               mentions="._device_mesh ="),  # the mesh transformers' tensor parallelism leaves on the model
    # The mark the `kernels` package (transformers' hub kernels) leaves on a module whose forward it replaced.
    PrivateAPI("kernels._internals.layer.layer", "_replace_forward", "read", "hf.support (hub_kernel_conflicts)",
               mentions='__dict__["_kernel_repo"] = repo', optional=True),
    # ---- attention: the dense paths and the mask functions (attention.interface)
    PrivateAPI("transformers.integrations.sdpa_attention", "sdpa_attention_forward", "called", "attention.interface",
               positional=("module", "query", "key", "value", "attention_mask"), keywords=("dropout", "scaling")),
    PrivateAPI("transformers.integrations.sdpa_attention", "repeat_kv", "called", "attention.interface",
               positional=("hidden_states", "n_rep")),
    PrivateAPI("transformers.masking_utils", "sdpa_mask", "called", "attention.interface"),
    PrivateAPI("transformers.masking_utils", "eager_mask", "called", "attention.interface"),
    # ---- training: whether generate runs inside a sharded training step (integrations.batch_generate)
    PrivateAPI("transformers.integrations.deepspeed", "is_deepspeed_zero3_enabled", "called",
               "integrations.batch_generate"),
    PrivateAPI("transformers.integrations.fsdp", "is_fsdp_managed_module", "called", "integrations.batch_generate",
               positional=("module",)),
)

# The private attribute names hf_paged reads as `obj._name` off transformers / torch objects (what
# tests/test_layout.py allows beside `self._x`): the registry's, and torch's below.
TORCH_PRIVATES = {
    "_version": "torch.Tensor._version, the in-place write counter (weights-changed detection in hf.weights)",
    "_linear_pointwise": "torch.ops.mkldnn._linear_pointwise, Inductor's oneDNN linear, probed before use (hf.linear)",
    "_dynamo": "torch._dynamo.config.patch(recompile_limit=), the knob torch's own error names (attention.flex_paged)",
    "_exit": "os._exit, public despite its name: how a disaggregated worker ends without blocking teardown",
    "_run_finalizers": "multiprocessing.util._run_finalizers(0), what an exit runs first: a worker ending with "
                       "os._exit unlinks its named semaphores (disagg.worker.exit_process)",
}


def private_names() -> set[str]:
    """Every private attribute name hf_paged may read off a transformers or torch object."""
    names = {part for api in PRIVATE_API for part in api.name.split(".") if part.startswith("_")
             and not part.startswith("__")}
    return names | set(TORCH_PRIVATES)


def _resolve(api: PrivateAPI):
    obj = importlib.import_module(api.module)
    for part in filter(None, api.name.split(".")):
        obj = getattr(obj, part)
    return obj


def _parameters(obj) -> list[inspect.Parameter] | None:
    """`obj`'s parameters, without a leading `self` / `cls` (a classmethod read off its class has none)."""
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[1:] if params and params[0].name in ("self", "cls") else params


def problem(api: PrivateAPI) -> str | None:
    """What about `api` no longer matches the installed transformers, or None."""
    where = f"transformers {installed_version()}: {api.qualified} ({api.how} by hf_paged.{api.used_by})"
    try:
        obj = _resolve(api)
    except ModuleNotFoundError as exc:
        if api.optional and exc.name == api.module.split(".")[0]:
            return None
        return f"{where} is gone ({type(exc).__name__}: {exc})"
    except (ImportError, AttributeError) as exc:
        return f"{where} is gone ({type(exc).__name__}: {exc})"
    if api.mentions is not None:
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):
            return f"{where}: its source cannot be read to find {api.mentions!r}"
        if api.mentions not in source:
            return f"{where} no longer mentions {api.mentions!r}"
    if not (api.positional or api.keywords):
        return None
    if isinstance(obj, type):
        obj = obj.__init__
    params = _parameters(obj)
    if params is None:
        return f"{where}: its signature cannot be read"
    named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if tuple(named[: len(api.positional)]) != api.positional:
        return (f"{where} changed its signature: hf_paged passes ({', '.join(api.positional)}) first, it now takes "
                f"({', '.join(named)})")
    by_name = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [k for k in api.keywords if k not in by_name]
    if missing:
        return f"{where} changed its signature: it no longer takes {', '.join(missing)} (it takes {', '.join(named)})"
    return None


def problems() -> list[str]:
    """One line per `PRIVATE_API` entry that no longer matches the installed transformers."""
    return [p for p in map(problem, PRIVATE_API) if p is not None]


def installed_version() -> str:
    """The installed transformers' version (read off the module in `sys.modules`: transformers may
    replace its lazy top-level module after an early import took a reference to it)."""
    import transformers

    return transformers.__version__


def is_supported_version(version: str | None = None) -> bool:
    """Whether `version` (default: the installed transformers) is inside `SUPPORTED_TRANSFORMERS`."""
    from packaging.version import Version

    version = installed_version() if version is None else version
    low, high = map(Version, SUPPORTED_TRANSFORMERS)
    return low <= Version(Version(version).base_version) < high


def untested_allowed() -> bool:
    """Whether the user asked to patch a transformers outside the supported range
    (`HF_PAGED_ALLOW_UNTESTED_TRANSFORMERS=1`)."""
    return os.environ.get(ALLOW_UNTESTED_ENV, "0") not in ("", "0", "false", "False")


@functools.lru_cache(maxsize=None)
def stock_penalty_skips_padding() -> bool:
    """Whether the installed `generate` builds its repetition penalty to skip each row's left padding
    (`prompt_ignore_length` from the attention mask, from 5.23 on). Before, a padded row's padding ids
    count as tokens it has seen: their logits are penalised, which the engine (it never sees the
    padding) cannot reproduce, so such a call runs stock generate."""
    import transformers.generation.utils as generation

    try:
        return "prompt_ignore_length" in inspect.getsource(generation.GenerationMixin._get_logits_processor)
    except (OSError, TypeError):
        return False


def local_load_kwargs() -> dict:
    """What hf_paged's own loaders (the default model, `hf-paged serve` / `run` on a folder) pass to
    `from_pretrained`: files from disk only, and no hub kernels unless the user chose them with
    `USE_HUB_KERNELS` (from 5.25 transformers kernelizes by default, which on a GPU fetches kernel code
    from the hub: a download the `local_files_only` load promised not to make)."""
    kwargs: dict = {"local_files_only": True}
    if HUB_KERNELS_ENV not in os.environ:
        kwargs["use_kernels"] = False
    return kwargs
