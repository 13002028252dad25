"""Models named on the command line: a local folder, a factory `module:callable`, or "default" (the
embedded SmolLM2-135M-Instruct). Shared by `hf-paged serve` and the disaggregated engine's workers
(`ModelFromPath` is picklable: it crosses to each worker process), so it belongs to neither: a leaf
that imports only the leaf `transformers_api` (the default model is named by its factory's path).

`check_model_path` validates such an argument before anything loads (it imports neither torch nor
transformers), so a typo is one line naming it, not a traceback from deep inside `from_pretrained`."""

from __future__ import annotations

import importlib.util
import os
import re

from .transformers_api import local_load_kwargs

# `--model default`: the package's embedded model, named by its factory (nothing in the chain imports defaults).
DEFAULT_FACTORY = "hf_paged.defaults.models:load_default"
# The dtypes a command line offers for the model's weights; "auto" keeps the checkpoint's.
DTYPES = ("auto", "float32", "bfloat16", "float16")

# What the Hub accepts as a repo id: "name" or "org/name", letters, digits, "-", "_" and "." (no "--" or "..").
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class ModelPathError(ValueError):
    """A model argument that names nothing loadable here; its message is one line naming the argument."""


def check_model_path(model: str) -> str:
    """Check a command-line model argument before anything loads; torch and transformers stay unimported.

    Accepted: "default"; a factory `module:callable` whose module can be found; a local folder holding
    `config.json`; a Hub id (`org/name`) whose `config.json` is already in the local Hugging Face cache.
    A Hub id that is not cached is refused: hf_paged loads from disk only (`local_files_only`), and
    downloading is left to the user.

    Args:
        model: the argument as typed.

    Returns:
        The argument normalized: "default", the factory as typed, a folder as an absolute path, or the Hub id.

    Raises:
        ModelPathError: what is missing, in one line naming `model`.
    """
    if not isinstance(model, str) or not model.strip():
        raise ModelPathError(f"model {model!r}: give a model folder, 'default' or 'module:callable'")
    if model == "default":
        return model
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return _check_folder(model, path)
    if _FACTORY.match(model):
        return _check_factory(model)
    if _HUB_ID.match(model) and not model.startswith((".", "~")) and ".." not in model and "--" not in model:
        return _check_hub_id(model)
    raise ModelPathError(f"model folder {model!r} does not exist")


def _check_folder(model: str, path: str) -> str:
    if not os.path.isdir(path):
        raise ModelPathError(f"model path {model!r} is a file; pass the folder that holds config.json")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelPathError(f"model folder {model!r} has no config.json; pass a transformers model folder "
                             "(config.json and weights, as save_pretrained writes)")
    return os.path.abspath(path)


def _check_factory(model: str) -> str:
    module = model.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing or broken
        found = False
    if not found:
        raise ModelPathError(f"model factory {model!r}: no module named {module!r} (use 'module:callable' "
                             "with the module on the Python path, or a model folder)")
    return model


def _check_hub_id(model: str) -> str:
    from huggingface_hub import try_to_load_from_cache  # ~0.2 s, only on this path

    try:
        cached = try_to_load_from_cache(model, "config.json")
    except ValueError:  # huggingface_hub's own validation refused the id
        cached = None
    if isinstance(cached, str):
        return model
    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
                  for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    why = "offline (HF_HUB_OFFLINE)" if offline else "hf_paged loads from disk only"
    raise ModelPathError(f"model {model!r} is neither a local folder nor in the local Hugging Face cache, and "
                         f"{why}: download it first (hf download {model} --local-dir DIR) and pass the folder")


class ModelFromPath:
    """A picklable model factory for the command line: a local model folder, or a factory named
    `module:callable` (called with `attn_implementation="hf_paged"`, returning a model or
    `(model, tokenizer)`); "default" is the embedded SmolLM2-135M-Instruct.

    Args:
        path: the command line's model argument (see `check_model_path`).
        tensor_parallel_size: > 1 loads with transformers' tensor parallelism.
        dtype: one of `DTYPES`; "auto" keeps the checkpoint's (a factory's own choice).
    """

    def __init__(self, path: str, tensor_parallel_size: int = 1, dtype: str = "auto"):
        self.path = DEFAULT_FACTORY if path == "default" else path
        self.tensor_parallel_size = tensor_parallel_size  # > 1: loaded with transformers' tensor parallelism
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
        self.dtype = dtype  # "auto": the checkpoint's (a factory's choice); else a torch dtype name

    def _load_kwargs(self) -> dict:
        if self.tensor_parallel_size == 1:
            return {}
        from transformers.distributed import DistributedConfig

        return {"distributed_config": DistributedConfig(tp_size=self.tensor_parallel_size)}

    def __call__(self, tokenizer_only: bool = False):
        if ":" in self.path and not os.path.isdir(self.path):
            import importlib

            module, _, name = self.path.partition(":")
            built = getattr(importlib.import_module(module), name)(attn_implementation="hf_paged",
                                                                   **self._load_kwargs())
            model, tokenizer = built if isinstance(built, tuple) else (built, None)
            if tokenizer_only:
                return None, tokenizer
            return (model if self.dtype == "auto" else model.to(self._torch_dtype())), tokenizer
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
        from transformers.models.auto import modeling_auto

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError):  # a folder without a tokenizer: token-id prompts only
            tokenizer = None
        if tokenizer_only:
            return None, tokenizer
        model_type = AutoConfig.from_pretrained(self.path, local_files_only=True).model_type
        auto = AutoModelForCausalLM
        if (model_type not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                and model_type in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
            auto = AutoModelForImageTextToText  # a vision-language model (LLaVA, Mistral 3, ...)
        dtype = {} if self.dtype == "auto" else {"dtype": self._torch_dtype()}
        return auto.from_pretrained(self.path, attn_implementation="hf_paged",
                                    **(local_load_kwargs() | self._load_kwargs() | dtype)), tokenizer

    def _torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def processor(self):
        """The folder's multimodal processor (transformers' `AutoProcessor`), or None: a factory, the
        default model, or a folder whose processor handles text only."""
        if not os.path.isdir(self.path):
            return None
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError, TypeError):
            return None
        return processor if getattr(processor, "image_processor", None) is not None else None


def resolve_placement(device: str | None, dtype: str):
    """Where the model runs and the dtype it loads in: the one rule for `--device` and `--dtype`.

    Args:
        device: "cpu", "cuda" or "cuda:N"; None: cuda where a GPU is, else cpu.
        dtype: one of `DTYPES`. "auto": the checkpoint's on a GPU, float32 on the CPU (whose kernels are
            fastest and exact in fp32).

    Returns:
        `(torch.device, dtype)`: the dtype as `ModelFromPath` takes it, a name of `DTYPES` ("auto" only
        on a GPU, where it keeps the checkpoint's).

    Raises:
        ValueError: an unknown device or dtype, or a GPU that is not there; one line naming the flag.
    """
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        where = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        where = None
    if where is None or where.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: use cpu, cuda or cuda:N")
    if where.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {device}: no CUDA device is available here (use --device cpu)")
        if (where.index or 0) >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return where, ("float32" if dtype == "auto" and where.type == "cpu" else dtype)
