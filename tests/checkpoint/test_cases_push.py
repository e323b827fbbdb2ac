"""``deltafy push`` refusing what must not go up, a row each: a real ``python -m deltafy`` subprocess on a
copy of the tiny converted checkpoint, its exit code, its one line, and the files it must leave alone.

A row that pushes for real (no --dry-run) talks to a Hub at a closed port with a token in HF_TOKEN:
its check passes only by firing before the first request, since a request would end in "could not
reach the Hub" instead.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from helpers.cases import Case, assert_case, run_table

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = pytest.mark.slow

REPO = "me/smol-ddl"
TOKEN = "hf_" + "UsersOwnToken0123456789abcdefghijk"  # HF_TOKEN's, in the rows that have a login
OTHERS = "hf_" + "SomebodyElses0123456789abcdefghij"  # shaped like a Hub token, not the user's
# Online, a login, and nothing listening: any request fails with "could not reach the Hub".
CLOSED = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_" + "f" * 34}
LOGIN = {"HF_TOKEN": TOKEN}


def _checkpoint(here: Path, paths: dict) -> Path:
    ckpt = here / "ckpt"
    shutil.copytree(paths["delta"], ckpt)
    return ckpt


def _link_to_file(here: Path, paths: dict) -> dict:
    """``ln -s ~/.ssh/id_ed25519 key`` inside the checkpoint."""
    secret = here / "id_ed25519"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (_checkpoint(here, paths) / "key").symlink_to(secret)
    return {"secret": os.path.realpath(secret)}


def _link_to_folder(here: Path, paths: dict) -> dict:
    private = here / "private"
    private.mkdir()
    (private / "passwords.txt").write_text("hunter2\n")
    (_checkpoint(here, paths) / "extra").symlink_to(private)
    return {"secret": os.path.realpath(private)}


def _links_inside(here: Path, paths: dict) -> dict:
    """A link to a file inside goes as that file; linked folders, a loop among them, stay behind."""
    ckpt = _checkpoint(here, paths)
    (ckpt / "notes.md").write_text("my notes\n")
    (ckpt / "alias.md").symlink_to("notes.md")
    (ckpt / "loop").symlink_to(".")
    return {}


def _write(name: str, text: str):
    def prepare(here: Path, paths: dict) -> dict:
        with open(_checkpoint(here, paths) / name, "a") as fh:
            fh.write(text)
        return {}

    return prepare


def _metadata(token: str):
    def prepare(here: Path, paths: dict) -> dict:
        import torch
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(2)}, str(_checkpoint(here, paths) / "extra.safetensors"), metadata={"t": token})
        return {}

    return prepare


def _case(name: str, args: list[str], code: int, first: str, *, real: bool = False, **kw) -> Case:
    argv = ["push", "{here}/ckpt", "--repo", REPO, *args, *([] if real else ["--dry-run"])]
    env = {**(CLOSED if real else {}), **kw.pop("env", {})}
    return Case(name, argv, code, first, env=env, **kw)


def _revision(name: str, value: str, why: str, real: bool) -> Case:
    return _case(
        name,
        [f"--revision={value}"],
        1,
        f"--revision {value!r} is not a valid branch name: ",
        needles=(why,),
        real=real,
        prepare=_checkpoint_only,
        untouched=("{here}/ckpt",),
    )


def _checkpoint_only(here: Path, paths: dict) -> dict:
    _checkpoint(here, paths)
    return {}


LINK = "the link {link} in {here}/ckpt points outside it, to {secret}: "
CASES = [
    # -- only the folder's own files go up
    _case("link-to-file-dry-run", [], 1, LINK.replace("{link}", "key"), prepare=_link_to_file, untouched=("{secret}",)),
    _case(
        "link-to-file-push",
        [],
        1,
        LINK.replace("{link}", "key"),
        real=True,
        prepare=_link_to_file,
        untouched=("{secret}", "{here}/ckpt"),
    ),
    _case("link-to-folder-dry-run", [], 1, LINK.replace("{link}", "extra"), prepare=_link_to_folder),
    _case(
        "link-to-folder-push",
        [],
        1,
        LINK.replace("{link}", "extra"),
        real=True,
        prepare=_link_to_folder,
        untouched=("{secret}",),
    ),
    _case("links-inside-dry-run", [], 0, f"{REPO} · public · full checkpoint", prepare=_links_inside),
    # -- no token goes up, and a dry run checks that too
    _case(
        "own-token-in-card-dry-run",
        [],
        1,
        "{here}/ckpt/README.md contains your Hub token",
        env=LOGIN,
        prepare=_write("README.md", f"\nPushed with {TOKEN}.\n"),
        untouched=("{here}/ckpt",),
    ),
    _case(  # the user's token, whatever its shape, is looked for as it is
        "own-old-style-token-in-metrics-dry-run",
        [],
        1,
        "{here}/ckpt/metrics.jsonl contains your Hub token",
        env={"HF_TOKEN": "api_org_MyOldToken"},
        prepare=_write("metrics.jsonl", '{"t": "api_org_MyOldToken"}\n'),
    ),
    _case(
        "own-token-in-safetensors-metadata-dry-run",
        [],
        1,
        "{here}/ckpt/extra.safetensors contains your Hub token in its safetensors header (__metadata__)",
        env=LOGIN,
        prepare=_metadata(TOKEN),
    ),
    _case(
        "own-token-in-safetensors-metadata-push",
        [],
        1,
        "{here}/ckpt/extra.safetensors contains your Hub token in its safetensors header",
        real=True,
        env=LOGIN,
        prepare=_metadata(TOKEN),
    ),
    _case(  # no login at all: a token-shaped string is still found
        "other-token-in-notes-dry-run",
        [],
        1,
        "{here}/ckpt/notes.txt contains a Hub access token",
        prepare=_write("notes.txt", f"a colleague's token: {OTHERS}\n"),
    ),
    _case(
        "other-token-in-safetensors-metadata-push",
        [],
        1,
        "{here}/ckpt/extra.safetensors contains a Hub access token",
        real=True,
        prepare=_metadata(OTHERS),
    ),
    # -- the revision is a branch name, or a pull request
    *[
        _revision(f"revision-{label}-{'push' if real else 'dry-run'}", value, why, real)
        for label, value, why in [
            ("space", "a b", "it holds a space"),
            ("dots", "..x", "it holds .."),
            ("dash", "-x", "it starts with -"),
            ("lock", "x.lock", "ends with .lock"),
        ]
        for real in (False, True)
    ],
    _case(  # interrupted: never exit 0
        "sigterm-during-push",
        [],
        143,
        "interrupted by SIGTERM",
        real=True,
        prepare=_checkpoint_only,
        untouched=("{here}/ckpt",),
        interrupt=(signal.SIGTERM, 1.0),
    ),
    _case(
        "revision-pull-request-dry-run",
        ["--revision", "refs/pr/1"],
        0,
        f"{REPO} (pull request refs/pr/1) · public",
        prepare=_checkpoint_only,
    ),
]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("push-cases")
    hf_home = root / "hf-home"  # no cached login, no telemetry: only what a row's env gives
    env = {"HF_HOME": str(hf_home), "HF_TOKEN": "", "HF_HUB_DISABLE_TELEMETRY": "1"}
    paths = {"delta": str(tiny.delta), "root": str(root)}
    return run_table(CASES, paths, root, env)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_push_case(runs, case):
    assert_case(case, runs[case.name])


def test_no_row_shows_a_token(runs):
    for name, result in runs.items():
        output = result.proc.stdout + result.proc.stderr
        assert TOKEN not in output and OTHERS not in output and "api_org_MyOldToken" not in output, name


def test_links_inside_go_up_as_files_and_linked_folders_stay_behind(runs):
    stdout = runs["links-inside-dry-run"].proc.stdout
    listing, _, left_out = stdout.partition("left out:")
    assert "alias.md" in listing and "notes.md" in listing
    assert "loop" in left_out.splitlines()[0]
