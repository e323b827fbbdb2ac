"""Every way users change a loaded model's weights, and the check that each is seen.

Run by tests/model/test_weight_changes.py in its own process and, as source, in a deltafy-free child
process: it imports torch and transformers only.
"""

import inspect

import torch
from transformers import DynamicCache


def heads_of(model):
    return {n: p for n, p in model.named_parameters() if ".delta." in n}


def decode_and_full(model, ids, prompt=3):
    """(token-by-token logits with the KV cache, full-forward logits)."""
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        full = model(input_ids=ids).logits
        cache = DynamicCache(config=model.config)
        steps = [model(input_ids=ids[:, :prompt], use_cache=True, **{key: cache}).logits]
        for i in range(prompt, ids.shape[1]):
            steps.append(model(input_ids=ids[:, i : i + 1], use_cache=True, **{key: cache}).logits)
    return torch.cat(steps, 1), full


def new_heads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in heads_of(model).items()
    }


def stock_drift(load, ids):
    """max |decode - full| of the model with every gate shut (beta = 0 exactly): the base model's
    own drift between cached decoding and a full forward, from rounding alone."""
    model = load()
    with torch.no_grad():
        for name, param in heads_of(model).items():
            if ".gate." in name:
                param.fill_(-200.0 if name.endswith("bias") else 0.0)
    decoded, full = decode_and_full(model, ids)
    return (decoded - full).abs().max().item()


def change_every_way(load, ids):
    """For each way of changing the heads of a freshly loaded model that has already run (so
    anything it might cache is built): (max |decode - full|, max |full - expected|, max |full - before|),
    where expected is a fresh load given the same weights before its first forward."""
    results = {}

    def same_weights(model):  # a fresh load with the model's parameters and buffers (rotary's too)
        fresh = load()
        fresh.load_state_dict(model.state_dict())
        with torch.no_grad():
            for buffer, mine in zip(fresh.buffers(), model.buffers(), strict=True):
                buffer.copy_(mine)
        return fresh

    def in_place(model, new):
        with torch.no_grad():
            for name, param in heads_of(model).items():
                param.copy_(new[name])

    def data_swap(model, new):  # the idiom FSDP and ZeRO-3 use to swap parameters
        for name, param in heads_of(model).items():
            param.data = new[name].clone()

    def state_dict(model, new):
        model.load_state_dict(new, strict=False)

    def state_dict_assign(model, new):
        model.load_state_dict({k: v.clone() for k, v in new.items()}, strict=False, assign=True)

    def optimizer(model, new):
        params = list(heads_of(model).values())
        opt = torch.optim.AdamW(params, lr=0.05)
        model.train()
        for _ in range(3):
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        model.eval()

    def to_dtype(model, new):
        in_place(model, new)
        model.to(torch.bfloat16)
        model.to(torch.float32)  # every tensor rounded through bf16, then fp32 again

    def to_device(model, new):  # to the meta device and back, as deferred-init and offloading flows do
        state = {**model.state_dict(), **new}
        buffers = {n: b.clone() for n, b in model.named_buffers()}  # (non-persistent ones too: rotary)
        model.to("meta")
        model.to_empty(device="cpu")
        model.load_state_dict(state)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
        if torch.cuda.is_available():  # a real device where there is one
            model.to("cuda")
            model.to("cpu")

    for way in (in_place, data_swap, state_dict, state_dict_assign, optimizer, to_dtype, to_device):
        model = load()
        before = decode_and_full(model, ids)[1]  # the first forward: whatever would be cached is built
        new = new_heads(model, seed=len(results))
        way(model, new)
        decoded, full = decode_and_full(model, ids)
        expected = decode_and_full(same_weights(model), ids)[1]
        results[way.__name__] = (
            (decoded - full).abs().max().item(),
            (full - expected).abs().max().item(),
            (full - before).abs().max().item(),
        )
    return results
