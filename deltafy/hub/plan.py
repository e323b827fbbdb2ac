"""What a push sends, decided before any request: the folder must be a complete deltafy checkpoint,
only its own files go (a link pointing outside it is refused), a running job's lock never goes, and the
training state (resumable Trainer checkpoints with optimizer moments, several times the model's size) only
on request. ``metrics.jsonl`` does go: a few KB of loss numbers behind the card's figures. No file may hold
a Hub token, the user's own or any other. Also the branch a push may name, and its commit message.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from ..checkpoint import read_config
from ..errors import DeltafyError, first_line
from ..files import CARD_FILE, HEADS_FILE, LOCK_FILE, MODELING_FILE, STATE_DIR

LOCK_PATTERNS = [LOCK_FILE, f"*/{LOCK_FILE}", "*.lock"]
TRAINING_PATTERNS = [STATE_DIR, f"{STATE_DIR}/*", "*optimizer.pt", "*scheduler.pt", "*rng_state*.pth"]
_BINARY_SUFFIXES = (".bin", ".pt", ".pth", ".gguf")  # not searched for tokens (a .safetensors' header is)
# huggingface_hub's access tokens: "hf_" and 34 letters and digits; 30 or more catches a clipped one too.
_TOKEN_SHAPE = re.compile(rb"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{30,}")
_PR_REVISION = re.compile(r"refs/pr/\d+")  # a pull request's ref, as huggingface_hub's SPECIAL_REFS_REVISION_REGEX


# -- what a complete checkpoint is ---------------------------------------------------------------


def check_checkpoint(folder: Path) -> tuple[dict, bool]:
    """The folder's config and whether it is heads-only; a DeltafyError naming what is missing."""
    if not folder.is_dir():
        raise DeltafyError(f"{folder} is not a folder; pass the folder `deltafy convert` or `deltafy train` wrote")
    partial = _is_partial(folder.name) or any(_is_partial(p.name) for p in folder.iterdir())
    if partial:
        raise DeltafyError(
            f"{folder} is a partial save (a .deltafy-partial-* folder, left by an interrupted or running "
            f"deltafy): push the finished checkpoint folder instead"
        )
    config = read_config(folder)  # no or unparsable config.json, no deltafy section: one line each
    if not (folder / MODELING_FILE).is_file():
        raise DeltafyError(f"{folder} is incomplete: no {MODELING_FILE}; convert or save it again with deltafy")
    full = _has_full_weights(folder)
    heads_only = not full and (folder / HEADS_FILE).is_file()
    if heads_only:
        if not config["deltafy"].get("base"):
            raise DeltafyError(
                f"{folder} holds only {HEADS_FILE} but its config.json names no base model; save it again "
                f"with deltafy (--heads-only)"
            )
        if "id" not in config["deltafy"]["base"]:
            raise DeltafyError(
                f"{folder} is a heads-only checkpoint of the local base {config['deltafy']['base'].get('path')}, "
                f"which nobody who downloads it can load: convert from a Hub model id with --heads-only, or push "
                f"a full copy (convert or train without --heads-only)"
            )
        _check_safetensors(folder / HEADS_FILE)
    elif not full:
        raise DeltafyError(
            f"{folder} is incomplete: no weights (model.safetensors, a sharded model.safetensors.index.json, "
            f"or {HEADS_FILE}); convert or save it again with deltafy"
        )
    if not (folder / CARD_FILE).is_file():
        raise DeltafyError(f"{folder} is incomplete: no README.md (its model card); save it again with deltafy")
    return config, heads_only


def _is_partial(name: str) -> bool:
    return name.startswith(".") and ".deltafy-partial-" in name


def _has_full_weights(folder: Path) -> bool:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        _check_safetensors(single)
        return True
    if not index.is_file():
        return False
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DeltafyError(f"{index} does not parse ({err}); save the checkpoint again with deltafy") from err
    for shard in shards:
        if not (folder / shard).is_file():
            raise DeltafyError(f"{folder} is incomplete: shard {shard}, listed in {index.name}, is missing")
        _check_safetensors(folder / shard)
    return True


def _check_safetensors(path: Path) -> None:
    """Refuse a truncated weights file: its header says how many bytes of tensors follow."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length)) if 8 + length <= size else None
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
        header = None
    if header is None or 8 + length + end != size:
        raise DeltafyError(f"{path} is truncated or not a safetensors file; save the checkpoint again with deltafy")


def front_matter_of(folder: Path) -> dict:
    from huggingface_hub import ModelCard

    try:
        return ModelCard.load(folder / CARD_FILE).data.to_dict()
    except Exception as err:  # a YAML error, or front matter that is not a mapping
        raise DeltafyError(f"the model card {folder / 'README.md'} does not parse: {first_line(err)}") from err


def upload_plan(folder: Path, ignore: list[str]) -> tuple[list[tuple[str, int]], list[str]]:
    """The files that go up (path in the repo, size in bytes), and the folder's entries left out.

    Only the folder's own files go: a link to a file inside it goes as that file, a link that points
    outside (to a file, a folder, or nowhere) is refused, and a linked folder is left out, not
    followed (as upload_folder's walk does; following could not end on a link loop). The filter is
    huggingface_hub's, with its own default patterns (.git and its cache).
    """
    from huggingface_hub.utils import filter_repo_objects
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

    root = os.path.realpath(folder)
    patterns = ignore + DEFAULT_IGNORE_PATTERNS
    files, left_out = [], []
    for rel, entry in sorted(_entries(folder), key=lambda item: item[0].split("/")):
        if not any(filter_repo_objects([rel], ignore_patterns=patterns)):
            left_out.append(rel)
            continue
        target = os.path.realpath(entry.path)
        if entry.is_symlink() and not _inside(target, root):
            raise DeltafyError(
                f"the link {rel} in {folder} points outside it, to {target}: only the folder's own files go "
                f"up; replace the link with a copy of what it points to, or remove it"
            )
        if os.path.isfile(target):  # a regular file, or a link to one inside
            files.append((rel, os.stat(target).st_size))
        else:  # a linked folder, a broken link, a pipe or socket: upload_folder leaves them out too
            left_out.append(rel)
    return files, left_out


def _entries(folder: Path, prefix: str = ""):
    """(path in the folder, entry) for everything below ``folder`` but its real subfolders, which are walked."""
    try:
        with os.scandir(folder) as it:
            entries = list(it)
    except OSError as err:
        raise DeltafyError(f"could not list {folder} ({err.strerror}); fix its permissions and push again") from err
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _entries(Path(entry.path), f"{prefix}{entry.name}/")
        else:
            yield prefix + entry.name, entry


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


# -- the revision ----------------------------------------------------------------------------------


def check_revision(revision: str | None) -> None:
    """Refuse a ``revision`` the Hub could not take as a branch name, before any request."""
    problems = [] if revision is None or _PR_REVISION.fullmatch(revision) else branch_name_problems(revision)
    if problems:
        raise DeltafyError(
            f"--revision {revision!r} is not a valid branch name: {', '.join(problems)}; name a branch such as "
            f"ddl-heads (letters, digits, - _ . /), or a pull request as refs/pr/<N>"
        )


def branch_name_problems(name: str) -> list[str]:
    """What makes ``name`` no branch name by git's rules (``git check-ref-format --branch``)."""
    parts = name.split("/")
    bad = sorted({c for c in name if c in "~^:?*[\\"})
    rules = [
        (name == "", "it is empty"),
        (name in ("@", "HEAD"), f"{name!r} names no branch in git"),
        (any(ord(c) < 32 or ord(c) == 127 for c in name), "it holds a control character"),
        (" " in name, "it holds a space"),
        (bool(bad), f"it holds {' '.join(bad)}"),
        (".." in name, "it holds .."),
        ("@{" in name, "it holds @{"),
        (name.startswith("-"), "it starts with -"),
        (name.startswith("/") or name.endswith("/"), "it starts or ends with /"),
        ("//" in name, "it holds //"),
        (any(part.startswith(".") for part in parts), "a part of it starts with ."),
        (any(part.endswith(".lock") for part in parts), "a part of it ends with .lock"),
        (name.endswith("."), "it ends with ."),
        (name.startswith("refs/pr/"), "refs/pr/ takes a pull request number"),
    ]
    return [why for broken, why in rules if broken]


def _base_name(config: dict, front_matter: dict) -> str:
    """The base model as people know it: the card's Hub id, else the source's name (never a local path)."""
    from ..card import base_model, public_name

    spec = config["deltafy"]
    provenance = spec.get("provenance", {})
    base = front_matter.get("base_model")
    if isinstance(base, list):
        base = base[0] if base else None
    base = base or base_model(spec, provenance)
    if base:
        return str(base)
    source = provenance.get("alias") or provenance.get("source")
    return public_name(str(source)) if source else spec.get("base_model_type", "a base model")


def default_commit_message(config: dict, front_matter: dict, heads_only: bool) -> str:
    from .. import __version__

    recipe = config["deltafy"].get("recipe", {}).get("name", "unknown")
    what = "Deep Delta Learning heads for" if heads_only else "Deep Delta Learning model from"
    return f"{what} {_base_name(config, front_matter)} (recipe {recipe}, deltafy {__version__})"


def new_branch(revision: str | None) -> bool:
    """Whether ``revision`` names a branch to create if missing (a pull request's ref already exists)."""
    from huggingface_hub import constants

    return bool(revision) and revision != constants.DEFAULT_REVISION and not _PR_REVISION.fullmatch(revision)


def local_token() -> str | None:
    """The token huggingface_hub would use, read without a request.

    get_token() may exchange an OIDC token or refresh an OAuth one over the network; those are minted
    on the spot, so no file can hold them.
    """
    try:
        from huggingface_hub.utils._auth import _get_token_from_environment, _get_token_from_file
    except ImportError:  # (private helpers: a huggingface_hub without them gets the public call)
        from huggingface_hub import get_token

        return get_token()
    return _get_token_from_environment() or _get_token_from_file()


def refuse_tokens_in_files(folder: Path, files: list[tuple[str, int]], secret: str | None) -> None:
    """A token written into a card, config, metrics file or weights' metadata must never be published."""
    for rel, _ in files:
        if rel.endswith(_BINARY_SUFFIXES):
            continue
        header = rel.endswith(".safetensors")
        found = _token_in(_safetensors_header(folder / rel) if header else _chunks(folder / rel), secret)
        where = " in its safetensors header (__metadata__)" if header else ""
        if found == "yours":
            raise DeltafyError(f"{folder / rel} contains your Hub token{where}; remove it from the file before pushing")
        if found:
            raise DeltafyError(
                f"{folder / rel} contains a Hub access token (hf_ and 30 or more letters and digits){where}; "
                f"remove it from the file before pushing"
            )


def _token_in(chunks, secret: str | None) -> str | None:
    """Which token the chunks hold: ``"yours"`` (``secret``), ``"token"`` (one shaped like any), or None."""
    needle = secret.encode() if secret else None
    tail = b""
    for chunk in chunks:
        text = tail + chunk
        if needle and needle in text:
            return "yours"
        if _TOKEN_SHAPE.search(text):
            return "token"
        tail = text[-max(64, len(needle or b"")) :]  # a token cut between two chunks
    return None


def _chunks(path: Path, size: int = 2**20):
    with open(path, "rb") as fh:
        while chunk := fh.read(size):
            yield chunk


def _safetensors_header(path: Path) -> list[bytes]:
    """The header's text (tensor names and ``__metadata__``), its JSON escapes decoded."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        raw = fh.read(min(length, 100 * 2**20))  # safetensors' own limit on a header
    try:
        return [json.dumps(json.loads(raw), ensure_ascii=False).encode()]
    except ValueError:
        return [raw]
