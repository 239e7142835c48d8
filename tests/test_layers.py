"""The Hub layers swapped into a tiny Llama-style model with `kernels.kernelize` match the unpatched model.

On a CPU machine the layers come from the `torch-cpu` variant (as users on CPU get them) and from the
`torch-cuda` variant under the Triton interpreter; on a GPU, from the variant `kernels` selects.
"""

import copy

import pytest
import torch
from kernels import KernelizeFallback, LocalLayerRepository, Mode, kernelize, use_kernel_mapping
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import DEVICE, EXACT_BF16_ROUNDING, ON_GPU
from model_helpers import VARIANTS, assert_same_step, loss_and_grads, variant_paths


def tiny_llama(dtype):
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=DEVICE, dtype=dtype)
    # Non-trivial norm weights, so a layer that ignored them would be caught.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernelize_tiny_llama_matches_unpatched(build_dir, variant):
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    reference = tiny_llama(dtype).train()
    patched = copy.deepcopy(reference)
    mapping = {"RMSNorm": {DEVICE.type: LocalLayerRepository(variant_paths(build_dir)[variant], layer_name="RMSNorm")}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        # Layers we do not map (rotary_pos_emb) keep their forward; everything else must load.
        patched = kernelize(patched, mode=Mode.TRAINING, device=DEVICE.type, use_fallback=KernelizeFallback.NO_LAYER)

    norms = [m for m in patched.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all(m.forward.__func__.__module__.endswith(".layers") for m in norms), \
        "kernelize did not swap in the Hub layer"

    input_ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    ref_logits, ref_grads = loss_and_grads(reference, input_ids)
    logits, grads = loss_and_grads(patched, input_ids)
    assert_same_step(logits, grads, ref_logits, ref_grads, dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("norm_class", ["olmo2.modeling_olmo2.Olmo2RMSNorm", "olmo3.modeling_olmo3.Olmo3RMSNorm",
                                        "gpt_oss.modeling_gpt_oss.GptOssRMSNorm"])
def test_kernelize_olmo_style_rms_norm(build_dir, variant, norm_class):
    """transformers names these norms "RMSNorm" too, but they multiply the weight in fp32 and cast once at the end
    (gpt-oss keeps the weight in fp32 while the model runs in bf16): `OlmoRMSNorm` has their numerics and output
    dtype, where `RMSNorm` (Llama's) rounds before the weight (a quarter of bf16 outputs one ulp off) and returns
    fp32 for an fp32 weight."""
    import importlib

    module_path, class_name = norm_class.rsplit(".", 1)
    stock_class = getattr(importlib.import_module(f"transformers.models.{module_path}"), class_name)

    class Wrapper(torch.nn.Module):  # kernelize swaps the modules inside a model
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

    layer = LocalLayerRepository(variant_paths(build_dir)[variant], layer_name="OlmoRMSNorm")
    for weight_dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(1)
        reference = Wrapper(stock_class(1000, eps=1e-5)).to(device=DEVICE, dtype=weight_dtype)
        with torch.no_grad():
            reference.norm.weight.uniform_(0.5, 1.5)
        patched = copy.deepcopy(reference)
        with use_kernel_mapping({"RMSNorm": {DEVICE.type: layer}}, inherit_mapping=False):
            patched = kernelize(patched, mode=Mode.TRAINING, device=DEVICE.type)
        assert patched.norm.forward.__func__.__module__.endswith(".layers"), "kernelize did not swap in the layer"
        x = torch.randn(3, 5, 1000, device=DEVICE, dtype=torch.bfloat16) * 4
        outputs = []
        for model in (reference, patched):
            xi = x.clone().requires_grad_()
            y = model.norm(xi)
            y.backward(torch.ones_like(y))
            outputs.append((y, xi.grad, model.norm.weight.grad))
        (y_ref, dx_ref, dw_ref), (y, dx, dw) = outputs
        assert y.dtype == y_ref.dtype == torch.bfloat16
        # The same fp32 math rounded once: equal up to one bf16 ulp, and where bf16 rounds to nearest as torch does
        # (not in the interpreter, which truncates: conftest) equal but for a few values on a rounding boundary.
        torch.testing.assert_close(y, y_ref, rtol=2**-7, atol=0)
        if EXACT_BF16_ROUNDING or variant == "torch-cpu":
            assert (y != y_ref).float().mean() < 0.02, "more outputs differ than fp32 summation order explains"
        torch.testing.assert_close(dx, dx_ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(dw.float(), dw_ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not ON_GPU, reason="transformers' KernelConfig supports only accelerator devices (not cpu)")
def test_transformers_kernel_config_swaps_rms_norm(build_dir, monkeypatch):
    """The user path: `KernelConfig({"RMSNorm": ("myorg/fused-kernels:RMSNorm", {"revision": ...})})`, resolved
    offline through LOCAL_KERNELS, gives the unpatched model's outputs and gradients."""
    from transformers import KernelConfig

    monkeypatch.setenv("LOCAL_KERNELS", f"myorg/fused-kernels={build_dir}")
    reference = tiny_llama(torch.bfloat16).train()
    patched = copy.deepcopy(reference)
    config = KernelConfig({"RMSNorm": ("myorg/fused-kernels:RMSNorm", {"revision": "v1", "trust_remote_code": True})},
                          inherit_mapping=False)
    patched.set_use_kernels(True, config)
    norms = [m for m in patched.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all(m.forward.__func__.__module__.endswith(".layers") for m in norms)

    input_ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    ref_logits, ref_grads = loss_and_grads(reference, input_ids)
    logits, grads = loss_and_grads(patched, input_ids)
    torch.testing.assert_close(logits, ref_logits, rtol=2e-2, atol=2e-2)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------------------------------------
# rotary_pos_emb: a kernelizable *function*. transformers turns `apply_rotary_pos_emb` into one module-level
# instance per model file and kernelize rebinds that instance's forward, so the swap is process-wide for that
# model type: the fixture below puts the original back after each test.
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def restore_llama_rotary():
    from transformers.models.llama import modeling_llama

    yield modeling_llama.apply_rotary_pos_emb
    vars(modeling_llama.apply_rotary_pos_emb).pop("forward", None)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernelize_rotary_pos_emb_matches_unpatched(build_dir, variant, restore_llama_rotary):
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    reference = tiny_llama(dtype).train()
    input_ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    ref_logits, ref_grads = loss_and_grads(reference, input_ids)  # before the process-wide swap

    # A fresh model, not a deepcopy: a copy's `_kernel_funcs` would hold a copy of the function module, which
    # the attention's forward (calling the module-level function) never uses.
    patched = tiny_llama(dtype).train()
    layer = LocalLayerRepository(variant_paths(build_dir)[variant], layer_name="ApplyRotaryPosEmb")
    with use_kernel_mapping({"rotary_pos_emb": {DEVICE.type: layer}}, inherit_mapping=False):
        patched = kernelize(patched, mode=Mode.TRAINING, device=DEVICE.type, use_fallback=KernelizeFallback.NO_LAYER)
    rotary = restore_llama_rotary
    assert rotary.forward.__func__.__module__.endswith(".layers"), "kernelize did not swap in the Hub layer"
    assert all(rotary in m._kernel_funcs.values() for m in patched.modules()
               if type(m).__name__ == "LlamaAttention")

    logits, grads = loss_and_grads(patched, input_ids)
    assert_same_step(logits, grads, ref_logits, ref_grads, dtype)


@pytest.mark.skipif(not ON_GPU, reason="transformers' KernelConfig supports only accelerator devices (not cpu)")
def test_transformers_kernel_config_swaps_rotary_pos_emb(build_dir, monkeypatch, restore_llama_rotary):
    """`KernelConfig({"rotary_pos_emb": ("myorg/fused-kernels:ApplyRotaryPosEmb", {"revision": ...})})`."""
    from transformers import KernelConfig

    monkeypatch.setenv("LOCAL_KERNELS", f"myorg/fused-kernels={build_dir}")
    reference = tiny_llama(torch.bfloat16).train()
    input_ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    ref_logits, ref_grads = loss_and_grads(reference, input_ids)

    patched = tiny_llama(torch.bfloat16).train()
    config = KernelConfig({"rotary_pos_emb": ("myorg/fused-kernels:ApplyRotaryPosEmb",
                                              {"revision": "v1", "trust_remote_code": True})}, inherit_mapping=False)
    patched.set_use_kernels(True, config)
    assert restore_llama_rotary.forward.__func__.__module__.endswith(".layers")

    logits, grads = loss_and_grads(patched, input_ids)
    torch.testing.assert_close(logits, ref_logits, rtol=2e-2, atol=2e-2)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=2e-2, atol=2e-2, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------------------------------------
# The causal-LM layer replaces a forward that transformers wraps (@can_return_tuple) and that slices the final
# hidden states with `slice_logits_to_keep`: the swapped-in forward must do both as the stock one does.
# ----------------------------------------------------------------------------------------------------------

def kernelized_causal_lm(build_dir, variant):
    """(stock, kernelized) tiny Llamas in float32 with random weights, the causal-LM forward swapped for ours; a
    subclass, so the layer name attached here stays local to the test."""
    from kernels import LocalLayerRepository, replace_kernel_forward_from_hub

    class TinyLlama(LlamaForCausalLM):
        pass

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    reference = TinyLlama(config).to(DEVICE)
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.5)
    patched = copy.deepcopy(reference)
    name = "FusedLinearCrossEntropyForCausalLM"
    replace_kernel_forward_from_hub(TinyLlama, name)
    layer = LocalLayerRepository(variant_paths(build_dir)[variant], layer_name=name)
    with use_kernel_mapping({name: {DEVICE.type: layer}}, inherit_mapping=False):
        patched = kernelize(patched, mode=Mode.TRAINING, device=DEVICE.type)
    assert patched.forward.__func__.__module__.endswith(".layers"), "kernelize did not swap in the Hub layer"
    return reference, patched


@pytest.mark.parametrize("variant", VARIANTS)
def test_causal_lm_layer_honours_return_dict(build_dir, variant):
    """`model(..., return_dict=False)` gives the stock forward's tuple; it crashed reading `last_hidden_state` of
    the tuple the decoder then returned."""
    reference, patched = kernelized_causal_lm(build_dir, variant)
    input_ids = torch.randint(0, 97, (2, 7), device=DEVICE)
    for training in (False, True):
        reference.train(training)
        patched.train(training)
        out = patched(input_ids=input_ids, labels=input_ids, return_dict=False)
        ref = reference(input_ids=input_ids, labels=input_ids, return_dict=False)
        assert isinstance(out, tuple)
        # In training with labels the layer builds no logits: (loss, past_key_values) against (loss, logits, ...).
        torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)
        if not training:
            assert len(out) == len(ref)
            torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_causal_lm_layer_keeps_the_positions_transformers_keeps(build_dir, variant):
    """`logits_to_keep` as a 2-D tensor: integer positions per sequence, or a bool mask of kept positions (packed
    training, with `shift_labels` for the kept positions). A 2-D integer tensor gave logits of shape (B, B, P, V),
    a mask raised an IndexError, and in training the fused loss ignored `logits_to_keep` altogether."""
    reference, patched = kernelized_causal_lm(build_dir, variant)
    input_ids = torch.randint(0, 97, (2, 7), device=DEVICE)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0], [1, 0, 0, 1, 1, 1, 1]], dtype=torch.bool, device=DEVICE)
    positions = torch.tensor([[1, 4, 5], [0, 2, 6]], device=DEVICE)
    reference.eval()
    patched.eval()
    with torch.no_grad():
        for keep in (mask, positions, torch.tensor([1, 4], device=DEVICE), 3):
            out = patched(input_ids=input_ids, logits_to_keep=keep)
            ref = reference(input_ids=input_ids, logits_to_keep=keep)
            torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)

    reference.train()
    patched.train()
    shift_labels = torch.randint(0, 97, (int(mask.sum()),), device=DEVICE)
    shift_labels[2] = -100
    losses, grads = [], []
    for model in (reference, patched):
        model.zero_grad()
        loss = model(input_ids=input_ids, labels=input_ids, shift_labels=shift_labels, logits_to_keep=mask).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_causal_lm_layer_takes_the_calls_ignore_index(build_dir, variant):
    """`model(..., labels=..., ignore_index=-1)`, which the stock forward passes to ForCausalLMLoss: the fused loss
    padded the shifted labels with -100 and ignored nothing else (NaN from the -1 targets)."""
    reference, patched = kernelized_causal_lm(build_dir, variant)
    input_ids = torch.randint(0, 97, (2, 7), device=DEVICE)
    labels = input_ids.clone()
    labels[:, :3] = -1
    for model in (reference, patched):
        model.train()
    loss = patched(input_ids=input_ids, labels=labels, ignore_index=-1).loss
    want = reference(input_ids=input_ids, labels=labels, ignore_index=-1).loss
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_causal_lm_layer_calls_an_lm_head_with_hooks(build_dir, variant):
    """An lm_head with a forward hook (as LoRA wrappers, quantised heads and FSDP2 sharding it on its own change what
    calling it does) is called as a module in training too: the fused loss read its weight and skipped the hook."""
    reference, patched = kernelized_causal_lm(build_dir, variant)
    input_ids = torch.randint(0, 97, (2, 7), device=DEVICE)
    losses, grads = [], []
    for model in (reference, patched):
        model.train()
        model.lm_head.register_forward_hook(lambda module, inputs, output: output * 4.0)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.lm_head.weight.grad)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
