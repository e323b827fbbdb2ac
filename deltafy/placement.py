"""Where a converted model runs: whether a device the user names is there, and where its modules go
when it is loaded with ``device_map="auto"``.

accelerate's automatic map offloads whole decoder layers to the CPU or disk when they do not fit,
and a layer's DDL heads would go with it: an offloaded parameter is reloaded from its offload
copy at every forward, so heads placed there could never train. The map is computed as
transformers computes it, then every site's heads are moved to the device the model runs on.
"""

from __future__ import annotations

import torch
from torch import nn

OFFLOAD = ("cpu", "disk")
AUTO = ("auto", "balanced", "balanced_low_0", "sequential")


def usable_device(name: str) -> str:
    """``name`` if torch can run on that device here, else a ValueError that says why: a typo or a missing
    GPU is the user's to fix (the options models check ``--device`` with it before any work)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{name!r} is not a device; e.g. cpu, cuda, cuda:1, mps") from None
    backends = {"cuda": torch.cuda, "mps": torch.backends.mps, "xpu": getattr(torch, "xpu", None)}
    if device.type != "cpu" and device.type not in backends:
        raise ValueError(f"deltafy runs on cpu, cuda, mps or xpu, not {device.type}")
    backend = backends.get(device.type)
    if backend is not None and not backend.is_available():
        raise ValueError(f"{name}: torch {torch.__version__} finds no {device.type} device here; use cpu")
    count = backend.device_count() if backend is not None and hasattr(backend, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise ValueError(f"{name}: this machine has {count} {device.type} device(s), {device.type}:0 to :{count - 1}")
    return name


def usable_placement(name: str) -> str:
    """A ``--device`` that may also be "auto" (``place``'s): eval's."""
    return name if name == "auto" else usable_device(name)


def default_device() -> str | None:
    """Where eval and inspect run a model the user names no device for: the GPUs where there are any (a
    7B on the CPU takes minutes where a GPU takes seconds; a 70B needs several), else where it loads
    (None: the CPU)."""
    return "auto" if torch.cuda.is_available() else None


# Of a GPU's free memory, what the weights may fill: the rest holds a forward's activations (a batch
# of 8 x 256 tokens of a 128k vocabulary: 1 GB of float32 logits).
WEIGHTS_SHARE = 0.85


def place(model: nn.Module, device: str | None, max_memory: dict | None = None) -> nn.Module:
    """``model``, loaded on the CPU, where it runs: ``device``, or for "auto" accelerate's map over the
    GPUs in order (a model that fits the first stays whole on it), the layers they cannot take left on
    the CPU and run on the first GPU one at a time, every site's heads with the GPU that computes.
    ``max_memory``: what each GPU may hold (accelerate's form), default WEIGHTS_SHARE of its free memory."""
    if device != "auto":
        return model if device is None else model.to(device)
    from accelerate import dispatch_model
    from accelerate.utils import get_max_memory

    free = get_max_memory()
    memory = get_max_memory(max_memory) if max_memory else {k: int(v * WEIGHTS_SHARE) for k, v in free.items()}
    # the weights are in CPU memory already: what the GPUs do not take stays where it is
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    memory["cpu"] = max(free.get("cpu", 0), size)
    device_map = auto_device_map(model, "sequential", memory, None)  # (None: each tensor's own dtype)
    # the CPU's layers run where the heads are (accelerate would pick any GPU of the map); the KV cache is not
    # moved from layer to layer (transformers' own dispatch skips it too)
    skip = getattr(model, "_skip_keys_device_placement", None)
    return dispatch_model(model, device_map, main_device=computing(device_map), skip_keys=skip)


def input_device(model: nn.Module) -> torch.device:
    """Where ``model``'s input ids go: the device its input embeddings compute on. An embedding accelerate
    offloaded holds meta tensors and is brought in for each forward, onto its hook's execution device;
    otherwise the embedding's weights' device."""
    embedding = model.get_input_embeddings()
    execution = getattr(getattr(embedding, "_hf_hook", None), "execution_device", None)
    return torch.device(execution) if execution is not None else next(embedding.parameters()).device


def auto_device_map(model: nn.Module, strategy: str, max_memory: dict | None, dtype) -> dict[str, object]:
    """accelerate's map for ``model`` (a skeleton on the meta device, or a loaded model) under ``strategy``,
    as transformers' from_pretrained infers it, with the DDL heads kept resident."""
    from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map

    no_split = model._no_split_modules
    if strategy == "sequential":
        memory = get_max_memory(max_memory)
    else:
        memory = get_balanced_memory(
            model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype,
            low_zero=strategy == "balanced_low_0",
        )  # fmt: skip
    device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split, dtype=dtype)
    return heads_resident(model, device_map)


def computing(device_map: dict[str, object]):
    """The device a map's model computes on: the first that is not an offload target, else the CPU."""
    return next((d for d in device_map.values() if d not in OFFLOAD), "cpu")


def heads_resident(model: nn.Module, device_map: dict[str, object]) -> dict[str, object]:
    """``device_map`` with each site's heads (``...delta``) on the device the model computes on
    (``computing``), splitting an offloaded module into its children, which keep its placement,
    down to the heads."""
    compute = computing(device_map)
    placed = dict(device_map)
    sites = [name for name, module in model.named_modules() if name.endswith(".delta")]
    for site in sites:
        owner = max((k for k in placed if k == "" or site == k or site.startswith(k + ".")), key=len, default=None)
        if owner is None or placed[owner] == compute:
            continue
        while owner != site:  # replace the owner by its children (and own tensors), one level down
            device = placed.pop(owner)
            module = model.get_submodule(owner)
            prefix = owner + "." if owner else ""
            for name, _ in module.named_children():
                placed[prefix + name] = device
            for name, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)):
                placed[prefix + name] = device
            owner = next(prefix + n for n, _ in module.named_children() if (site + ".").startswith(prefix + n + "."))
        placed[site] = compute
    return placed
