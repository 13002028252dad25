"""Triton kernels of the paged attention: `store_kv`, the split-KV `decode`, the varlen flash
`prefill` and absorbed multi-head `latent` attention (MLA rows, read once for every query head), with the launchers' shared input `checks`, and their launch configurations: `tuning`
(recorded winners in `tuned_configs.json`, the pruned search behind HF_PAGED_AUTOTUNE) and `tune`
(the command a GPU session runs to record winners).

Each attention launcher has a plan (`decode.plan_decode`, `prefill.plan_prefill`): the tiling,
split count, launch configuration and scratch, chosen once per step and layer kind by the step's
`attention.plan.StepPlan` and passed to every layer's launch, which then computes, looks up and
allocates nothing but its output. A launch without a plan makes its own (`latent` always does: its
split buffers are allocated per call, and its launch settings are fixed by hand, not tuned).

Each file reads top-down: small `@triton.jit` helpers, the kernel with a shape comment on every
tensor argument, then one Python launcher that validates inputs and picks the grid. The kernels
know tensors and block tables only, never sequences, requests or transformers. Modules are imported
on first use by `attention.dispatch`, so importing hf_paged never compiles anything.
"""
