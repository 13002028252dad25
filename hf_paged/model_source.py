"""Models named on the command line: a local folder, a factory `module:callable`, or "default" (the
embedded SmolLM2-135M-Instruct). Shared by `hf-paged serve` and the disaggregated engine's workers
(`ModelFromPath` is picklable: it crosses to each worker process), so it belongs to neither: a leaf
that imports only the leaf `transformers_api` (the default model is named by its factory's path)."""

from __future__ import annotations

import os

from .transformers_api import local_load_kwargs

# `--model default`: the package's embedded model, named by its factory (nothing in the chain imports defaults).
DEFAULT_FACTORY = "hf_paged.defaults.models:load_default"


class ModelFromPath:
    """A picklable model factory for the command line: a local model folder, or a factory named
    `module:callable` (called with `attn_implementation="hf_paged"`, returning a model or
    `(model, tokenizer)`); "default" is the embedded SmolLM2-135M-Instruct."""

    def __init__(self, path: str, tensor_parallel_size: int = 1):
        self.path = DEFAULT_FACTORY if path == "default" else path
        self.tensor_parallel_size = tensor_parallel_size  # > 1: loaded with transformers' tensor parallelism

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
            return (None, tokenizer) if tokenizer_only else (model, tokenizer)
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
        return auto.from_pretrained(self.path, attn_implementation="hf_paged",
                                    **(local_load_kwargs() | self._load_kwargs())), tokenizer

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
