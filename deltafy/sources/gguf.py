"""A .gguf file written out as an HF-format folder a tensor at a time.

transformers' own GGUF load dequantizes every tensor into one state dict (a 7B Q4 file becomes
28 GB of fp32) before a model can be saved. Each tensor's conversion is independent for most
architectures, though: dequantize it, run the architecture's tensor processor (Llama's q/k
un-permutation, Gemma's norm offset, ...), rename it to the model's key. This module runs exactly
those pieces of transformers' legacy GGUF loader one tensor at a time into safetensors shards, so
the folder costs one tensor of memory and loads to the same weights as ``from_pretrained(gguf_file=)``
followed by ``save_pretrained``. Architectures whose conversion is not per tensor are reported as
such, and the caller loads them the old way.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .shards import INDEX_FILE, SINGLE_FILE, write_file

SHARD_BYTES = 2 * 1024**3

Progress = Callable[[int], None]


def _per_tensor_processors() -> tuple[type, ...]:
    """The tensor processors that turn one GGUF tensor into one model tensor and touch nothing else.
    The MoE ones (Qwen2-MoE, GPT-OSS, MiniMax-M2) merge or split experts across tensors, and GPT-2's
    stores its output head out of band: those files go through transformers' whole-model load."""
    from transformers import modeling_gguf_pytorch_utils as legacy

    names = [
        "TensorProcessor",
        "LlamaTensorProcessor",
        "BloomTensorProcessor",
        "T5TensorProcessor",
        "MambaTensorProcessor",
        "NemotronTensorProcessor",
        "Gemma2TensorProcessor",
        "Lfm2TensorProcessor",
    ]
    return tuple(getattr(legacy, name) for name in names if hasattr(legacy, name))


class _Tensor(NamedTuple):
    """Where one tensor's raw bytes lie in the file, and how gguf's dequantize wants them shaped."""

    name: str
    tensor_type: int
    raw_shape: tuple[int, ...]
    raw_dtype: np.dtype
    offset: int


@dataclass
class GgufPlan:
    """What a streamed GGUF folder holds, worked out from the file's header and a model on the meta device."""

    path: Path
    config: object  # the transformers config, as a dequantized load saves it
    generation_config: object | None
    tensors: list  # (_Tensor, model key, shape) in file order
    processor: object
    key_mapping: dict[str, str]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(torch.Size(shape).numel() * size for _, _, shape in self.tensors)

    def write(self, folder: Path, progress: Progress = lambda nbytes: None) -> None:
        """Write config, generation config and weights into ``folder`` (an empty staging folder:
        the caller moves it into place once everything, tokenizer included, is there)."""
        self.config.save_pretrained(folder)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(folder)
        shards = _shards(self.tensors, self.dtype)
        by_key = {key: tensor for tensor, key, _ in self.tensors}
        weight_map = {}
        with open(self.path, "rb") as fh:
            for name, members in shards.items():
                layout = [(key, self.dtype, shape) for _, key, shape in members]
                write_file(folder / name, layout, lambda key: self._tensor(fh, by_key[key]), progress)
                weight_map |= {key: name for _, key, _ in members}
        if len(shards) > 1:
            index = {"metadata": {"total_size": self.nbytes}, "weight_map": dict(sorted(weight_map.items()))}
            (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    def _tensor(self, fh, tensor) -> torch.Tensor:
        from gguf import dequantize

        # Read with plain file reads rather than through the reader's memory map: mapped pages would
        # stay in this process's resident set, and for a multi-GB file that is the whole file.
        raw = np.empty(tensor.raw_shape, dtype=tensor.raw_dtype)
        fh.seek(tensor.offset)
        if fh.readinto(memoryview(raw.reshape(-1).view(np.uint8))) != raw.nbytes:
            raise OSError(f"{self.path.name} is truncated (tensor {tensor.name})")
        weights = dequantize(raw, tensor.tensor_type)
        del raw
        processed = self.processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=self.key_mapping, parsed_parameters={"tensors": {}}
        ).weights
        del weights  # a processor that permutes returns a copy: hold one of the two
        # transformers' loader takes np.copy of each; a contiguous, writable array is the same bytes
        array = np.ascontiguousarray(processed)
        if not array.flags.writeable or not array.flags.owndata:
            array = array.copy()
        return torch.from_numpy(array).to(self.dtype)


def _shards(tensors: list, dtype: torch.dtype) -> dict[str, list]:
    """Tensors grouped in file order into files of at most SHARD_BYTES (a bigger tensor gets its own),
    named as save_pretrained names them."""
    size = torch.empty((), dtype=dtype).element_size()
    groups, current, filled = [], [], 0
    for member in tensors:
        nbytes = torch.Size(member[2]).numel() * size
        if current and filled + nbytes > SHARD_BYTES:
            groups.append(current)
            current, filled = [], 0
        current.append(member)
        filled += nbytes
    if current or not groups:
        groups.append(current)
    if len(groups) == 1:
        return {SINGLE_FILE: groups[0]}
    return {f"model-{i:05d}-of-{len(groups):05d}.safetensors": group for i, group in enumerate(groups, 1)}


def plan_gguf(path: Path, dtype: torch.dtype = torch.float32) -> GgufPlan | str:
    """The plan for writing ``path`` tensor by tensor, or why it has to be loaded whole. Reads only
    the file's header; errors reading it propagate (the caller words them)."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    from transformers.integrations.gguf.utils import is_gguf_arch_supported
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    reader = GGUFReader(str(path))
    architecture = read_field(reader, "general.architecture")[0]
    # Only the tensor table is kept: the parsed metadata (the vocabulary above all) is most of a
    # reader's memory, and transformers parses the file again for the config below.
    table = [
        _Tensor(t.name, t.tensor_type, tuple(t.data.shape), t.data.dtype, int(t.data_offset)) for t in reader.tensors
    ]
    del reader
    if is_gguf_arch_supported(architecture):
        return f"transformers loads {architecture} GGUF files through its own block-wise path"
    processor_class = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    if processor_class not in _per_tensor_processors():
        return f"transformers converts some {architecture} tensors together, not one at a time"

    processor = processor_class(config=load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    clear_quantizer(model)
    key_mapping = get_gguf_hf_weights_map(model, processor)

    # The keys save_pretrained writes: the model's state dict less its tied aliases.
    expected = remove_tied_weights_from_state_dict(model.state_dict(), model)
    conversions = copy.deepcopy(get_model_conversion_mapping(model))  # matching arms stateful renamings
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    tensors, seen = [], set()
    for tensor in table:
        key = key_mapping.get(tensor.name)
        if key is None:
            continue  # transformers skips tensors the model has no place for
        if key in seen or key not in expected:
            return f"{tensor.name} does not map to exactly one saved tensor"
        if rename_source_key(key, renamings, converters)[0] != key:
            return f"transformers renames {key} on load"
        seen.add(key)
        tensors.append((tensor, key, tuple(expected[key].shape)))
    missing = [key for key in expected if key not in seen]
    if missing:  # transformers would initialize these and save them; not this writer's job
        return f"{len(missing)} tensors of the model are not in the file (e.g. {missing[0]})"

    # What save_pretrained records about the model it saves.
    model.config.dtype = str(dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    generation_config = model.generation_config if model.can_generate() else None
    return GgufPlan(path, model.config, generation_config, tensors, processor, key_mapping, dtype)


def clear_quantizer(model) -> None:
    # A GGUF load is fully dequantized, but transformers keeps a quantizer marker that makes
    # save_pretrained refuse the model; the weights themselves are plain tensors.
    model.hf_quantizer = None
    model.is_quantized = False
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)


def dequantize_whole(path: Path):
    """The model of a .gguf file, dequantized whole by transformers, in fp32 (where plan_gguf says no)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, trust_remote_code=False
    )
    clear_quantizer(model)
    return model


def gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
