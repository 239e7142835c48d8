"""Every kernel of myorg/fused-kernels in a stock transformers causal LM, through kernels' and transformers' own
mechanisms only (no transformers function or attribute is patched by hand).

This is the README's copy-paste helper (section "Every kernel in one call"); keep the two copies identical.
It lives here, not in the kernel package, because the package's public API is versioned per release.
"""

from kernels import (
    KernelizeFallback,
    LayerRepository,
    Mode,
    kernelize,
    replace_kernel_forward_from_hub,
    use_kernel_mapping,
)


def use_fused_kernels(model, repo_id="myorg/fused-kernels", revision="v2", low_memory_loss=False,
                      attention=True):
    """Swap RMSNorm, RoPE, the gated MLP, the causal-LM loss and attention of a Llama, Qwen2/Qwen3, Mistral or
    Gemma-2 model (on its current device: CUDA, or CPU with the torch-cpu variant) for the Hub layers of
    `repo_id` at `revision`. Loads from the Hub, or from a local build through LOCAL_KERNELS. `low_memory_loss`:
    the loss uses fused linear cross-entropy's low-memory algorithm (more compute, no fp32 weight-gradient
    buffer). `attention=False` keeps the model's own attention implementation (e.g. SDPA, whose cuDNN backend
    PyTorch prefers on Hopper). Returns the model."""
    config = model.config
    gemma = config.model_type.startswith("gemma")
    activation = config.hidden_activation if gemma else config.hidden_act
    if activation not in (("gelu_pytorch_tanh",) if gemma else ("silu", "swish")):
        raise ValueError(f"{type(model).__name__}: no fused MLP layer for the activation {activation!r}")
    # Gemma's norms scale by (1 + weight) in fp32 and its MLPs gate with the tanh GELU.
    mlp = "GeGLUMLP" if gemma else "SwiGLUMLP"
    loss = "LowMemoryFusedLinearCrossEntropyForCausalLM" if low_memory_loss else "FusedLinearCrossEntropyForCausalLM"
    layers = {"RMSNorm": "GemmaRMSNorm" if gemma else "RMSNorm", "rotary_pos_emb": "ApplyRotaryPosEmb", mlp: mlp,
              "FusedLinearCrossEntropyForCausalLM": loss}  # model's name: our layer

    # transformers declares "RMSNorm" (except on Gemma-2's norm) and "rotary_pos_emb" itself; the MLP and the
    # causal-LM forward get layer names here. This sets class attributes (kernel_layer_name), which only
    # matter to kernelize: models of these classes keep their forwards until they are kernelized.
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and getattr(module, "kernel_layer_name", None) is None:
            replace_kernel_forward_from_hub(type(module), "RMSNorm")
    replace_kernel_forward_from_hub(type(model.model.layers[0].mlp), mlp)
    replace_kernel_forward_from_hub(type(model), "FusedLinearCrossEntropyForCausalLM")

    # kernels' device names are torch's ("cuda", "cpu"); transformers' KernelConfig would refuse "cpu".
    device = model.device.type
    mapping = {name: {device: LayerRepository(repo_id, layer_name=layer, revision=revision, trust_remote_code=True)}
               for name, layer in layers.items()}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        # NO_LAYER: modules nobody maps (transformers' activation layers) keep their forward; a mapped layer that
        # fails to load or validate raises instead of silently leaving the stock forward in place.
        model = kernelize(model, mode=Mode.TRAINING if model.training else Mode.INFERENCE, device=device,
                          use_fallback=KernelizeFallback.NO_LAYER)
    if attention:
        model.set_attn_implementation(f"{repo_id}@{revision}", allow_all_kernels=True)
    return model
