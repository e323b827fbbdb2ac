"""Run a model whose weights stay in safetensors files, one decoder layer in memory at a time.

A model built on the meta device (``empty_model``) holds shapes, not tensors. ``layer_by_layer``
makes each decoder layer (and each of the input and output embeddings) real only while it runs: a
forward pre-hook reads its tensors from the files, a forward hook puts them back on meta. A forward
then costs one read of the checkpoint and the memory of its largest layer plus the activations,
whatever the model's size: enough for the self-check of a model that does not fit in memory
(deltafy.conversion.verify.layerwise_self_check).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from ..errors import DeltafyError

# state-dict name -> (safetensors file, the tensor's key in that file)
Weights = Mapping[str, tuple[Path, str]]
Progress = Callable[[int, int], None]


def is_head(name: str) -> bool:
    """A DDL head's tensor: small, made by the conversion, never in the original's files."""
    return ".delta." in name


def empty_model(config, dtype: torch.dtype | None = None) -> nn.Module:
    """The causal LM of ``config`` on the meta device, in ``dtype`` (default: the config's own).

    Buffers stay real (``include_buffers=False``): the non-persistent ones such as rotary
    ``inv_freq`` are computed from the config, are not in any checkpoint, and would otherwise be lost.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # init_empty_weights re-creates every parameter it sees registered, so the ties transformers made
    # became two tensors; tied again outside it, a tied pair is one tensor, as layer_by_layer expects
    model.tie_weights()
    return model.eval()


def safetensors_weights(model: nn.Module, files: Iterable[str | Path]) -> dict[str, tuple[Path, str]]:
    """The weights mapping of ``model``'s state-dict names found in ``files``: under the name itself,
    or without the model's ``base_model_prefix`` (a checkpoint of the bare model, like GPT-2's
    ``h.0.attn.c_attn.weight``). Names stored under another key (renamed or fused on load) are left
    out; layer_by_layer then names them."""
    from safetensors import safe_open

    found: dict[str, tuple[Path, str]] = {}
    for file in map(Path, files):
        with safe_open(file, framework="pt") as handle:
            found.update((key, (file, key)) for key in handle.keys())
    prefix = getattr(model, "base_model_prefix", "") + "."
    weights = {}
    for name in model.state_dict(keep_vars=True):
        for key in (name, name.removeprefix(prefix)):
            if key in found:
                weights[name] = found[key]
                break
    return weights


def assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in place of ``model``'s parameter or buffer ``name`` (a meta one included)."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    if attr in module._parameters:
        old = module._parameters[attr]
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=old.requires_grad)
    elif attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        raise DeltafyError(f"{type(module).__name__} at {path!r} has no tensor {attr!r}")


def _with_tied(tensors: dict[str, torch.Tensor], weights: Weights) -> dict[str, tuple[Path, str]]:
    """``weights`` plus the names tied to a mapped one (lm_head to the embeddings): a tied pair is
    one tensor in the meta model and is stored once, under either name. Each of the two modules
    reads it in its own forward, so neither keeps the other's copy alive."""
    resolved = {name: (Path(file), key) for name, (file, key) in weights.items() if name in tensors}
    by_tensor = defaultdict(list)
    for name, tensor in tensors.items():
        by_tensor[id(tensor)].append(name)
    for names in by_tensor.values():
        stored = next((resolved[n] for n in names if n in resolved), None)
        if stored is not None:
            for name in names:
                resolved.setdefault(name, stored)
    return resolved


def _missing(tensors: dict[str, torch.Tensor], resolved: Mapping) -> list[str]:
    return [n for n, t in tensors.items() if not is_head(n) and n not in resolved and t.is_meta]


def missing_weights(model: nn.Module, weights: Weights) -> list[str]:
    """The names of ``model`` that layer_by_layer would find no weights for: not mapped, not tied
    to a mapped name, not real already. Not empty for a checkpoint whose keys transformers renames
    or fuses on load (MoE experts, GPT-NeoX's ``embed_out``): load such a model whole instead."""
    tensors = model.state_dict(keep_vars=True)
    return _missing(tensors, _with_tied(tensors, weights))


def _layer_path(model: nn.Module) -> str:
    spec = getattr(model.config, "deltafy", None)
    if spec:
        return spec["layers"]
    from ..architectures import layout_for

    return layout_for(model.config).layers


class _Resident:
    """Which of a meta model's tensors are real, read from where, and the hooks that swap them.

    Made real only while they run (*units*): each decoder layer, and the input and output
    embeddings, the largest tensors outside the layers (2 GB each for Llama 3 70B in bf16). The rest
    (final norm, position embeddings) is real for the whole block. At most one unit is real at a time.
    """

    def __init__(self, model: nn.Module, weights: Weights, layers: str, progress: Progress | None):
        self.model, self.progress = model, progress
        self.tensors = model.state_dict(keep_vars=True)  # the meta tensors, put back after each use
        self.weights = _with_tied(self.tensors, weights)
        decoder = model.get_submodule(layers)
        self.layer_units = {f"{layers}.{i}": i for i in range(len(decoder))}
        self.n_layers = len(decoder)
        path_of = {id(module): path for path, module in model.named_modules()}
        units = list(self.layer_units)
        for module in (model.get_input_embeddings(), model.get_output_embeddings()):
            if module is not None and path_of.get(id(module)) not in (None, *units):
                units.append(path_of[id(module)])
        self.units: dict[str, list[str]] = {unit: [] for unit in units}
        self.outer: list[str] = []
        for name in self.tensors:
            if is_head(name):
                if self.tensors[name].is_meta:
                    raise DeltafyError(f"the DDL head {name} is on the meta device: assign the heads first")
                continue
            unit = next((u for u in units if name.startswith(u + ".")), None)
            (self.units[unit] if unit is not None else self.outer).append(name)
        self.resident: str | None = None  # the unit that is real now
        self.handles: list = []

    def check_files(self) -> None:
        """Every tensor is mapped, and in its file with its shape: a bad mapping fails before any work."""
        from safetensors import safe_open

        if missing := _missing(self.tensors, self.weights):
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise DeltafyError(f"no weights for {shown}: not in the mapping, not tied, not already real")
        by_file = defaultdict(list)
        for name, (file, key) in self.weights.items():
            by_file[file].append((name, key))
        for file, entries in by_file.items():
            try:
                with safe_open(file, framework="pt") as handle:
                    keys = set(handle.keys())
                    for name, key in entries:
                        if key not in keys:
                            raise DeltafyError(f"{file} has no tensor {key!r} (the weights of {name})")
                        shape = tuple(handle.get_slice(key).get_shape())
                        if shape != tuple(self.tensors[name].shape):
                            raise DeltafyError(
                                f"{file}: {key!r} has shape {list(shape)}, the model's {name} "
                                f"{list(self.tensors[name].shape)}"
                            )
            except OSError as err:
                raise DeltafyError(f"cannot read {file}: {err}") from err

    def load(self, names: list[str]) -> None:
        """Read ``names`` from their files, in the dtype of the tensors they replace."""
        from safetensors import safe_open

        by_file = defaultdict(list)
        for name in names:
            if name in self.weights:
                file, key = self.weights[name]
                by_file[file].append((name, key))
        for file, entries in by_file.items():
            # The handle is closed at once: safetensors' tensors map the file's pages rather than copy
            # them, and a mapping lives exactly as long as the tensors read from it.
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name, key in entries:
                    assign(self.model, name, handle.get_tensor(key).to(self.tensors[name].dtype))

    def release(self, names: list[str]) -> None:
        """Put the original meta tensors back (the same objects: tied names stay one tensor)."""
        for name in names:
            if name in self.weights:
                path, _, attr = name.rpartition(".")
                module = self.model.get_submodule(path)
                slots = module._parameters if attr in module._parameters else module._buffers
                slots[attr] = self.tensors[name]

    def enter(self) -> None:
        self.check_files()
        self.load(self.outer)
        for unit in self.units:
            module = self.model.get_submodule(unit)
            self.handles.append(module.register_forward_pre_hook(self._pre(unit), prepend=True))
            # always_call: a forward that raises inside the unit still puts it back on meta
            self.handles.append(module.register_forward_hook(self._post(unit), always_call=True))

    def _pre(self, unit: str):
        def hook(module, args):
            if self.resident is not None:  # left over from a forward interrupted before its hook
                self.release(self.units[self.resident])
            self.load(self.units[unit])
            self.resident = unit

        return hook

    def _post(self, unit: str):
        def hook(module, args, output):
            self.release(self.units[unit])
            self.resident = None
            if self.progress is not None and unit in self.layer_units:
                self.progress(self.layer_units[unit] + 1, self.n_layers)

        return hook

    def exit(self) -> None:
        for handle in self.handles:
            handle.remove()
        if self.resident is not None:
            self.release(self.units[self.resident])
        self.release(self.outer)


@contextlib.contextmanager
def layer_by_layer(model: nn.Module, weights: Weights, *, layers: str | None = None, progress: Progress | None = None):
    """Run ``model`` (built on the meta device, on the CPU) with its weights read from ``weights``.

    ``weights`` maps state-dict names to (safetensors file, key in it). A name it lacks must be tied
    to one it has (lm_head to the embeddings) or be real already, like the DDL heads, which are never
    read. Each decoder layer (under ``layers``, default the family's path) and the input and output
    embeddings are real only during their own forward, so at most one of them is in memory; the other
    modules outside the layers (final norm) for the whole block. ``progress(done, total)`` is called
    as each decoder layer finishes. On exit every hook is gone and the model holds its meta tensors
    again (the same objects, so ties hold); buffers and heads that were real stay real.
    """
    resident = _Resident(model, weights, layers or _layer_path(model), progress)
    try:
        resident.enter()
        yield model
    finally:
        resident.exit()
