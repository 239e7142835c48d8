"""transformers loads our flash attention as a Hub attention kernel (`attn_implementation="myorg/fused-kernels@v2"`,
offline through LOCAL_KERNELS) and trains tiny random-init models with it: logits, loss and gradients of the bf16
model on our kernel are within twice the error of the same bf16 model on transformers' own attention (`sdpa`;
`eager` for Gemma-2), both against that model in float32, through every path transformers takes (dense batch,
padding mask unpadded to varlen, packed sequences from restarting position_ids), with GQA, a sliding window and
soft-capping. Our model must call the kernel in every layer, the others never.

On CPU `kernels` selects the torch-cpu variant (the portable implementation); on a GPU, the arch variant with
the Triton kernels.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import DEVICE
from model_helpers import kernel_calls

REPO = "myorg/fused-kernels"
IMPLEMENTATION = f"{REPO}@v2"

CONFIGS = {
    # GQA (4 q heads, 2 kv heads), head_dim 16.
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128),
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=128),
    # A sliding window shorter than the sequences, so the window really masks.
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, sliding_window=6),
    # Soft-capped attention logits (Gemma-2).
    "gemma2": dict(model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                   attn_logit_softcapping=5.0, sliding_window=6, query_pre_attn_scalar=16),
}


# transformers' own attention for each family: Gemma-2 has no sdpa path (soft-capping), so it runs eager.
REFERENCE_IMPLEMENTATION = {"gemma2": "eager"}
# Query and key projections scaled up so that attention scores reach the soft cap (from random init they stay far
# below it, where soft-capping changes nothing a test could see).
QK_WEIGHT_SCALE = {"gemma2": 8.0}


def build_models(name):
    """(exact, stock, ours): the same weights in a float32 model and a bf16 one on transformers' own attention, and a
    bf16 one on our kernel. Each has its own config: `from_config` keeps the object it is given, so with one config
    `set_attn_implementation` on ours switched the others to our kernel too (and the test compared the kernel with
    itself)."""
    settings = dict(CONFIGS[name])
    model_type = settings.pop("model_type")
    torch.manual_seed(0)
    implementation = REFERENCE_IMPLEMENTATION.get(name, "sdpa")
    exact, stock, ours = (AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings),
                                                           attn_implementation=implementation, dtype=dtype)
                          for dtype in (torch.float32, torch.bfloat16, torch.bfloat16))
    with torch.no_grad():
        for layer in exact.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                projection.weight.mul_(QK_WEIGHT_SCALE.get(name, 1.0))
    stock.load_state_dict(exact.state_dict())
    ours.load_state_dict(exact.state_dict())
    ours.set_attn_implementation(IMPLEMENTATION, allow_all_kernels=True)
    assert exact.config._attn_implementation == stock.config._attn_implementation == implementation
    assert ours.config._attn_implementation == IMPLEMENTATION
    return exact.to(DEVICE), stock.to(DEVICE), ours.to(DEVICE)


def batch_inputs(kind):
    generator = torch.Generator().manual_seed(1)
    if kind == "dense":
        ids = torch.randint(0, 128, (2, 13), generator=generator)
        return {"input_ids": ids, "labels": ids}
    if kind == "padding":
        ids = torch.randint(0, 128, (3, 11), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, :4] = 0  # left padding
        mask[2, 7:] = 0  # right padding
        # No label where the token or the one before it is padding: the loss reads the logits of position t for
        # the label of t + 1, and a padding row's output is each implementation's own (sdpa and eager attend a
        # row that sees nothing uniformly, varlen skips it).
        before = torch.cat([torch.ones_like(mask[:, :1]), mask[:, :-1]], dim=1)
        labels = ids.masked_fill((mask == 0) | (before == 0), -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    # packed: three documents in one row, positions restarting at each
    ids = torch.randint(0, 128, (1, 17), generator=generator)
    positions = torch.cat([torch.arange(length) for length in PACKED_DOCUMENTS])[None]
    return {"input_ids": ids, "position_ids": positions, "labels": ids}


PACKED_DOCUMENTS = (5, 8, 4)


def run_documents_apart(model, inputs):
    """(logits, loss) of a packed row computed one document at a time: transformers' own attention does not read
    documents from restarting position_ids (only flash-attention implementations do), so its reference is each
    document alone, with the loss transformers computes over the row (every position predicts the next token)."""
    ids = inputs["input_ids"].to(DEVICE)
    bounds = torch.tensor((0,) + PACKED_DOCUMENTS).cumsum(0).tolist()
    logits = torch.cat([model(input_ids=ids[:, start:end]).logits for start, end in zip(bounds, bounds[1:])], dim=1)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), inputs["labels"][0, 1:].to(DEVICE))
    return logits, loss


def run(model, inputs, attention_calls, documents_apart=False):
    """Logits, loss and gradients of one step, which must call our attention ``attention_calls`` times (once per
    layer, or never); ``documents_apart``: see ``run_documents_apart``."""
    model.zero_grad(set_to_none=True)
    if documents_apart:
        logits, loss = run_documents_apart(model, inputs)
    else:
        out = model(**{k: v.to(DEVICE) for k, v in inputs.items()})
        logits, loss = out.logits, out.loss
    assert sum(kernel_calls(loss).values()) == attention_calls
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.float().detach(), loss.float().detach(), grads


def check_rule(name, ours, stock, exact):
    """The package's rule: our error against the float32 model within twice the stock bf16 model's, plus a floor
    of bf16 rounding, both relative to the largest magnitude."""
    scale = exact.abs().max().item() or 1.0
    ours_err, stock_err = ((t - exact).abs().max().item() / scale for t in (ours, stock))
    assert ours_err <= 2 * stock_err + 2**-8, (
        f"{name}: error {ours_err:.3e} against the stock bf16 model's {stock_err:.3e}")


@pytest.mark.parametrize("kind", ["dense", "padding", "packed"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_attn_implementation_matches_transformers_attention(build_dir, monkeypatch, name, kind):
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={build_dir}")
    exact, stock, ours = build_models(name)
    inputs = batch_inputs(kind)
    # sdpa and eager compute the padding rows too: compare the real tokens' logits only.
    keep = inputs["attention_mask"].bool() if kind == "padding" else torch.ones(inputs["input_ids"].shape, dtype=bool)
    keep = keep.to(DEVICE)
    results = {}
    for label, model in (("exact", exact), ("stock", stock)):
        results[label] = run(model, inputs, 0, documents_apart=kind == "packed")
    results["ours"] = run(ours, inputs, ours.config.num_hidden_layers)
    (logits, loss, grads), (stock_logits, stock_loss, stock_grads), (exact_logits, exact_loss, exact_grads) = (
        results[label] for label in ("ours", "stock", "exact"))
    check_rule("logits", logits[keep], stock_logits[keep], exact_logits[keep])
    check_rule("loss", loss, stock_loss, exact_loss)
    assert grads.keys() == stock_grads.keys() == exact_grads.keys()
    for param, grad in grads.items():
        check_rule(f"grad {param}", grad, stock_grads[param], exact_grads[param])
