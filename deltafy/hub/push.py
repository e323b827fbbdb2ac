"""Publishing a checkpoint folder on the Hugging Face Hub, through huggingface_hub as its own CLI does.

What goes up is deltafy.hub.plan's to decide, before any request; ``dry_run`` runs every check a push runs
and shows exactly the files that go. The token is huggingface_hub's to find (``token=``, ``HF_TOKEN``, the
cached login); deltafy only passes it on, and scrubs it from any error text it shows.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DeltafyError, first_line
from ..options import push_options
from .plan import (
    LOCK_PATTERNS,
    TRAINING_PATTERNS,
    check_checkpoint,
    check_revision,
    default_commit_message,
    front_matter_of,
    local_token,
    new_branch,
    refuse_tokens_in_files,
    upload_plan,
)


@dataclass
class PushResult:
    """What was (or, for a dry run, would be) uploaded. Never holds the token."""

    repo: str
    files: list[tuple[str, int]]  # path in the repo, size in bytes
    front_matter: dict
    commit_message: str
    private: bool
    revision: str | None
    heads_only: bool
    dry_run: bool
    repo_url: str | None = None
    commit_url: str | None = None
    ignored: list[str] = field(default_factory=list)  # files of the folder left out

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def push(
    folder: str | Path,
    repo: str,
    *,
    dry_run: bool = False,
    before_upload: Callable[[PushResult], None] | None = None,
    **settings,
) -> PushResult:
    """Upload the deltafy checkpoint ``folder`` to the Hub model repo ``repo`` (created if missing);
    ``settings`` are PushOptions' (private, revision, message, token, include_training).

    ``revision`` names a branch, created from ``main`` when new, or a pull request (``refs/pr/N``).
    ``dry_run`` runs the same checks and returns what would be uploaded without a single request.
    ``before_upload`` is called with that plan once the folder, the Hub's reachability and the token
    are checked, before the first request.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as err:
        raise DeltafyError(f"--repo {repo!r} is not a Hub repository id; use OWNER/NAME, e.g. me/smol-ddl") from err
    options = push_options(**settings)
    private, revision, message, token = options.private, options.revision, options.message, options.token
    folder = Path(folder).expanduser()
    config, heads_only = check_checkpoint(folder)
    front_matter = front_matter_of(folder)
    check_revision(revision)
    ignore = LOCK_PATTERNS + ([] if options.include_training else TRAINING_PATTERNS)
    files, ignored = upload_plan(folder, ignore)
    refuse_tokens_in_files(folder, files, token or local_token())
    result = PushResult(
        repo=repo,
        files=files,
        front_matter=front_matter,
        commit_message=message or default_commit_message(config, front_matter, heads_only),
        private=private,
        revision=revision,
        heads_only=heads_only,
        dry_run=dry_run,
        ignored=ignored,
    )
    if dry_run:
        return result
    _upload(folder, result, token, before_upload)
    return result


# -- the upload ------------------------------------------------------------------------------------


def _upload(folder: Path, result: PushResult, token: str | None, before_upload) -> None:
    import httpx2
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    if constants.is_offline_mode():
        raise DeltafyError(_OFFLINE)
    secret = token or get_token()
    if not secret:
        raise DeltafyError(_NOT_LOGGED_IN)
    if before_upload is not None:
        before_upload(result)
    api = HfApi(token=token)  # None: huggingface_hub finds the same token again itself
    # private=None, as `hf upload` does: a new repo then follows its namespace's default visibility.
    try:
        repo_url = api.create_repo(result.repo, repo_type="model", exist_ok=True, private=result.private or None)
        repo_id = repo_url.repo_id
        if new_branch(result.revision):
            api.create_branch(repo_id, branch=result.revision, repo_type="model", exist_ok=True)
        # upload_folder walks the folder itself; allowing exactly the planned paths makes it send the plan.
        commit = api.upload_folder(
            folder_path=folder,
            repo_id=repo_id,
            repo_type="model",
            revision=result.revision,
            commit_message=result.commit_message,
            allow_patterns=[_literal(rel) for rel, _ in result.files],
        )
    except OfflineModeIsEnabled as err:  # set after the check above
        raise DeltafyError(_OFFLINE) from err
    except LocalTokenNotFoundError as err:
        raise DeltafyError(_NOT_LOGGED_IN) from err
    except HfHubHTTPError as err:
        raise DeltafyError(_scrub(_http_message(err, result.repo), secret)) from err
    except httpx2.TransportError as err:
        raise DeltafyError(
            _scrub(
                f"could not reach the Hub at {constants.ENDPOINT} ({type(err).__name__}: {first_line(err)}); check "
                f"the network (or HF_ENDPOINT) and run the command again, or pass --dry-run to see what would go up",
                secret,
            )
        ) from None  # not even --debug shows the unscrubbed text

    except ValueError as err:  # the Hub's YAML check of the card, or a revision it cannot commit to
        raise DeltafyError(_scrub(f"the Hub refused the upload: {first_line(err)}", secret)) from None
    result.repo_url = str(repo_url)
    result.commit_url = getattr(commit, "commit_url", None) or str(commit)


_NOT_LOGGED_IN = (
    "not logged in to the Hugging Face Hub: run `hf auth login`, set HF_TOKEN, or pass --token (a token with "
    "write access)"
)
_OFFLINE = (
    "the Hub is unreachable (HF_HUB_OFFLINE is set): unset HF_HUB_OFFLINE to push, or pass --dry-run "
    "to see what would be uploaded"
)


def _http_message(err, repo: str) -> str:
    status = getattr(getattr(err, "response", None), "status_code", None)
    if status == 401:
        return (
            f"the Hub refused the token (401) while pushing to {repo}: log in again with `hf auth login`, set "
            f"HF_TOKEN, or pass --token with a valid token that has write access"
        )
    if status == 403:
        return (
            f"the token may not write to {repo} (403): use a token with write access to "
            f"{repo.split('/')[0]}, or push to a repository you own"
        )
    if status == 404:
        return f"the Hub found no repository {repo} you can write to (404): check --repo and that your token can see it"
    server = getattr(err, "server_message", None) or first_line(err)
    return f"the Hub answered {status or 'an error'} while pushing to {repo}: {first_line(server)}"


def _scrub(text: str, secret: str) -> str:
    return text.replace(secret, "***") if secret else text


def _literal(path: str) -> str:
    """An fnmatch pattern matching exactly ``path``: its wildcard characters in brackets."""
    return re.sub(r"([*?\[])", r"[\1]", path)
