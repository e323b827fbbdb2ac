"""What a conversion records about its source: a file's SHA-256, the license its card or GGUF metadata
states, and the provenance of a local folder or a .gguf file (a Hub model's is made where it is loaded)."""

from __future__ import annotations

from pathlib import Path


def sha256_file(path: Path) -> str:
    # The checkpoint's own code hashes a heads-only checkpoint's base the same way: one implementation.
    from ..modeling_deltafy import sha256_files

    return sha256_files([Path(path)])[Path(path).name]


def card_license(readme: str | Path | None) -> str | None:
    """The ``license`` of a model card's front matter, when there is one to read."""
    from huggingface_hub import metadata_load

    try:
        license_ = metadata_load(readme).get("license") if readme else None
    except Exception:  # no card, no front matter or bad YAML: the license is simply unknown
        return None
    return license_ if isinstance(license_, str) else None


def gguf_license(path: Path) -> str | None:
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields.get("general.license")
        value = field.contents() if field is not None else None
    except Exception:  # an old gguf without contents(), or metadata it cannot parse
        return None
    return value if isinstance(value, str) and value else None


def hub_license(repo_id: str, revision: str | None) -> str | None:
    """The license on a Hub model's card: from the local cache, else fetched (a few KB) unless offline."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    try:
        readme = try_to_load_from_cache(repo_id, "README.md", revision=revision)
        if not isinstance(readme, str) and not constants.HF_HUB_OFFLINE:
            readme = hf_hub_download(repo_id, "README.md", revision=revision)
    except Exception:  # no card on the Hub, or no connection: the license is unknown, not an error
        return None
    return card_license(readme) if isinstance(readme, str) else None


def with_license(provenance: dict, license_: str | None) -> dict:
    return provenance | {"license": license_} if license_ else provenance


def gguf_provenance(path: Path, digest: str) -> dict:
    # A file name and its hash identify it; the folder it sits in is this machine's business.
    return with_license({"kind": "gguf", "source": path.name, "sha256": digest}, gguf_license(path))


def local_provenance(path: Path) -> dict:
    provenance = {
        "kind": "local",
        "source": path.resolve().name,  # the folder's name, never its place on this machine
        "config_sha256": sha256_file(path / "config.json"),
    }
    readme = path / "README.md"
    return with_license(provenance, card_license(readme) if readme.is_file() else None)
