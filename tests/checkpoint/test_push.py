"""``deltafy push`` through huggingface_hub's real upload code, with only the network replaced.

huggingface_hub sends every request through one shared client made by its client factory; the
factory installed here gives a client whose transport records each request and answers it as the
Hub does, so create_repo, create_branch and upload_folder run unchanged and the test reads exactly
what would have gone up: the repo's privacy, the branch, the committed files and the message.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import httpx2
import huggingface_hub
import pytest
from helpers.cli import assert_one_line_error, cli
from helpers.models import tiny_model
from huggingface_hub import constants
from huggingface_hub.utils._http import default_client_factory, hf_request_event_hook

import deltafy
from deltafy.cli import main
from deltafy.hub.push import push

TOKEN = "hf_deltafyTestToken0123456789abcdefXYZ"  # HF_TOKEN's
CLI_TOKEN = "hf_givenOnTheCommandLine9876543210zyx"  # --token's
REPO = "me/smol-ddl"
BASE = "HuggingFaceTB/SmolLM2-135M"
MODEL_FILES = {"README.md", "config.json", "generation_config.json", "model.safetensors", "modeling_deltafy.py"}
MODEL_FILES |= {"recipe.yaml", "metrics.jsonl"}
TRAINING_FILES = {"training/checkpoint-2/optimizer.pt", "training/checkpoint-2/trainer_state.json", "training/run.json"}


class RecordingHub:
    """An httpx transport handler that answers the Hub API calls of an upload and keeps every request."""

    def __init__(self):
        self.requests: list[SimpleNamespace] = []
        self.fail: dict[str, int | Exception] = {}  # a path suffix -> the status (or error) to answer with

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        body = request.read()
        path = request.url.path
        if path.endswith("-harnesses"):  # huggingface_hub's own once-a-day telemetry registry fetch, best effort
            return httpx2.Response(404)
        self.requests.append(SimpleNamespace(method=request.method, path=path, headers=request.headers, body=body))
        for suffix, failure in self.fail.items():
            if path.endswith(suffix):
                if isinstance(failure, Exception):
                    raise failure
                return httpx2.Response(failure, json={"error": f"refused with {failure}"})
        if path == "/api/repos/create":
            payload = json.loads(body)
            return httpx2.Response(
                200, json={"url": f"https://huggingface.co/{payload['organization']}/{payload['name']}"}
            )
        if path == "/api/validate-yaml":
            return httpx2.Response(200, json={"errors": [], "warnings": []})
        if "/branch/" in path:
            return httpx2.Response(200, json={})
        if "/preupload/" in path:
            # regular: the files then come inline in the commit body (no LFS or xet transfer to answer)
            asked = json.loads(body)["files"]
            files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in asked]
            return httpx2.Response(200, json={"files": files})
        if "/commit/" in path:
            oid = "0123456789abcdef0123456789abcdef01234567"
            url = f"https://huggingface.co/{REPO}/commit/{oid}"
            return httpx2.Response(200, json={"commitUrl": url, "commitOid": oid})
        return httpx2.Response(404, json={"error": f"no route {path}"})

    def paths(self) -> list[str]:
        return [r.path for r in self.requests]

    def commit(self) -> tuple[dict, dict[str, bytes]]:
        """The commit's header and its files (path -> content), parsed from the ndjson body."""
        (request,) = [r for r in self.requests if "/commit/" in r.path]
        lines = [json.loads(line) for line in request.body.decode().splitlines()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        added = [line["value"] for line in lines if line["key"] == "file"]
        files = {f["path"]: base64.b64decode(f["content"]) for f in added}
        return header, files


@pytest.fixture
def hub(monkeypatch):
    recorder = RecordingHub()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read once, when huggingface_hub is imported
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    # The real client's request hook stays: it is where huggingface_hub enforces offline mode.
    hooks = {"request": [hf_request_event_hook]}
    transport = httpx2.MockTransport(recorder)
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=transport, event_hooks=hooks))
    yield recorder
    huggingface_hub.set_client_factory(default_client_factory)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny converted llama saved by deltafy, as converted from a Hub model."""
    path = tmp_path_factory.mktemp("push") / "smol-delta"
    provenance = {"kind": "hub", "source": BASE, "revision": "main"}
    deltafy.save(deltafy.convert(tiny_model("llama-tied")), path, provenance=provenance)
    return path


@pytest.fixture
def folder(saved, tmp_path) -> Path:
    """A copy of the checkpoint as a finished training run leaves it: metrics, training state, a lock."""
    path = tmp_path / "smol-trained"
    shutil.copytree(saved, path)
    (path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    for rel in TRAINING_FILES:
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(b"optimizer moments" if rel.endswith(".pt") else b"{}")
    (path / ".deltafy-lock").write_text("1234\n")
    return path


def run(capsys, *args) -> SimpleNamespace:
    """``deltafy ARGS`` in this process (the transport hook is process-local), as a finished process."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exit:
        code = exit.code
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)


def assert_no_token(proc, *folders: Path) -> None:
    assert TOKEN not in proc.stdout + proc.stderr
    for folder in folders:
        for file in folder.rglob("*"):
            assert not file.is_file() or TOKEN.encode() not in file.read_bytes(), file


def test_push_private_branch_uploads_model_without_training_state(hub, folder, capsys):
    proc = run(capsys, "push", folder, "--repo", REPO, "--private", "--revision", "ddl-heads")
    assert proc.returncode == 0, proc.stderr
    paths = hub.paths()
    assert paths[0] == "/api/repos/create" and json.loads(hub.requests[0].body)["visibility"] == "private"
    assert f"/api/models/{REPO}/branch/ddl-heads" in paths
    assert any(p.startswith(f"/api/models/{REPO}/preupload/ddl-heads") for p in paths)
    assert paths[-1] == f"/api/models/{REPO}/commit/ddl-heads"
    header, files = hub.commit()
    assert set(files) == MODEL_FILES  # no training/, no lock
    assert files["config.json"] == (folder / "config.json").read_bytes()
    assert files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    message = header["summary"]
    assert f"deltafy {deltafy.__version__}" in message and BASE in message
    assert json.loads((folder / "config.json").read_text())["deltafy"]["recipe"]["name"] in message
    # The token went where it belongs, and nowhere else.
    assert all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in hub.requests)
    assert all(TOKEN.encode() not in content for content in files.values()) and TOKEN not in message
    assert_no_token(proc, folder)
    assert f"https://huggingface.co/{REPO}/commit/" in proc.stdout


def test_push_public_main_with_message_and_training_state(hub, folder, capsys):
    proc = run(capsys, "push", folder, "--repo", REPO, "--message", "first heads", "--include-training")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(hub.requests[0].body).get("visibility") != "private"
    assert not any("/branch/" in p for p in hub.paths())
    assert hub.paths()[-1] == f"/api/models/{REPO}/commit/main"
    header, files = hub.commit()
    assert header["summary"] == "first heads"
    assert set(files) == MODEL_FILES | TRAINING_FILES  # asked for: the training state, but never the lock
    assert_no_token(proc, folder)


def test_dry_run_sends_nothing_and_shows_files_and_front_matter(hub, folder, capsys):
    proc = run(capsys, "push", folder, "--repo", REPO, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert hub.requests == []
    for name in MODEL_FILES:
        assert name in proc.stdout
    assert "training/" not in proc.stdout.split("left out")[0]
    assert f"base_model: {BASE}" in proc.stdout and "library_name: transformers" in proc.stdout
    assert "7 files" in proc.stdout
    assert_no_token(proc, folder)


def test_push_settings_come_from_push_options(hub, folder, capsys):
    """One source for each push setting: the command's flags are PushOptions' fields (unset: None, so
    the model's default applies), and the library checks its keywords with the same model."""
    import inspect

    from deltafy.cli.push import push_command
    from deltafy.errors import DeltafyError
    from deltafy.options import PushOptions

    parameters = inspect.signature(push_command).parameters
    assert set(PushOptions.model_fields) <= set(parameters)
    assert all(parameters[name].default is None for name in PushOptions.model_fields)
    proc = run(capsys, "push", folder, "--repo", REPO, "-m", "short form", "--dry-run")  # -m: --message
    assert proc.returncode == 0 and "commit message: short form" in proc.stdout, proc.stderr
    with pytest.raises(DeltafyError, match=r"invalid push options: --privat: unknown key"):
        push(folder, REPO, dry_run=True, privat=True)  # a typo is refused, not ignored
    assert hub.requests == []


def _drop(name):
    return lambda path: (path / name).unlink()


def _write(name, text):
    return lambda path: (path / name).write_text(text)


def _truncate(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _sharded_missing_shard(path: Path) -> None:
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    shards = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))


def _stock_config(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config.pop("deltafy")
    (path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))


def _partial_inside(path: Path) -> None:
    (path / ".smol-trained.deltafy-partial-999").mkdir()


INCOMPLETE = {
    "no config": (_drop("config.json"), "no config.json"),
    "config does not parse": (_write("config.json", '{"model_type": "deltafy",'), "could not read"),
    "no deltafy section": (_stock_config, "not a deltafy checkpoint"),
    "no weights": (_drop("model.safetensors"), "no weights"),
    "truncated weights": (_truncate, "truncated"),
    "missing shard": (_sharded_missing_shard, "model-00002-of-00002.safetensors"),
    "no modeling file": (_drop("modeling_deltafy.py"), "modeling_deltafy.py"),
    "partial inside": (_partial_inside, "partial"),
    "token in a file": (_write("metrics.jsonl", f'{{"token": "{TOKEN}"}}\n'), "contains your Hub token"),
}


@pytest.mark.parametrize("kind", sorted(INCOMPLETE))
def test_refuses_an_incomplete_folder_with_one_line_and_no_request(hub, folder, capsys, kind):
    damage, needle = INCOMPLETE[kind]
    damage(folder)
    proc = run(capsys, "push", folder, "--repo", REPO)
    assert_one_line_error(proc, needle)
    assert hub.requests == []
    assert TOKEN not in proc.stdout + proc.stderr


def test_refuses_a_partial_save_folder(hub, folder, capsys):
    partial = folder.parent / ".smol-trained.deltafy-partial-4242"
    folder.rename(partial)
    assert_one_line_error(run(capsys, "push", partial, "--repo", REPO), "partial save")
    assert hub.requests == []


@pytest.mark.parametrize(("status", "needle"), [(401, "refused the token"), (403, "may not write"), (500, "500")])
def test_hub_refusal_is_one_line_without_the_token(hub, folder, capsys, status, needle):
    hub.fail["/api/repos/create"] = status
    proc = run(capsys, "push", folder, "--repo", REPO, "--token", CLI_TOKEN)
    assert_one_line_error(proc, needle)
    assert TOKEN not in proc.stdout + proc.stderr and CLI_TOKEN not in proc.stdout + proc.stderr
    assert hub.requests[0].headers["authorization"] == f"Bearer {CLI_TOKEN}"  # --token wins over HF_TOKEN


def test_unreachable_hub_is_one_line(hub, folder, capsys):
    hub.fail["/api/repos/create"] = httpx2.ConnectError(f"connection refused (token {TOKEN})")  # a worst case
    proc = run(capsys, "push", folder, "--repo", REPO)
    assert_one_line_error(proc, "could not reach the Hub", "--dry-run")
    assert TOKEN not in proc.stdout + proc.stderr  # scrubbed even from the transport's own message


def test_not_logged_in_is_one_line_and_sends_nothing(hub, folder, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    assert_one_line_error(run(capsys, "push", folder, "--repo", REPO), "hf auth login", "HF_TOKEN")
    assert hub.requests == []


def test_bad_repo_id_is_one_line(hub, folder, capsys):
    assert_one_line_error(run(capsys, "push", folder, "--repo", "me/not a repo"), "OWNER/NAME")
    assert hub.requests == []


def test_heads_only_folder_pushes_only_the_heads(hub, tmp_path, capsys):
    path = tmp_path / "heads"
    provenance = {"kind": "hub", "source": BASE, "revision": "0" * 40}  # a heads-only folder pins its base
    model = deltafy.convert(tiny_model("llama-tied"))
    deltafy.save(model, path, provenance=provenance, heads_only=True, base=BASE)
    proc = run(capsys, "push", path, "--repo", REPO)
    assert proc.returncode == 0, proc.stderr
    header, files = hub.commit()
    assert "deltafy_heads.safetensors" in files and "model.safetensors" not in files
    assert "heads for" in header["summary"] and BASE in header["summary"]


def test_heads_only_folder_of_a_local_base_is_refused(hub, tmp_path, capsys):
    """Its base lives on this machine: nobody who downloads the heads could load them."""
    base = tmp_path / "base"
    tiny_model("llama-tied").save_pretrained(base)
    path = tmp_path / "heads"
    deltafy.save(deltafy.convert(tiny_model("llama-tied")), path, heads_only=True, base=base)
    proc = run(capsys, "push", path, "--repo", REPO)
    assert_one_line_error(proc, "local base", "Hub model id")
    assert hub.requests == []


def test_cli_dry_run_works_offline(folder):
    """The real command, with HF_HUB_OFFLINE set: a dry run needs no network at all."""
    proc = cli("push", folder, "--repo", REPO, "--private", "--dry-run", cwd=folder.parent, env={"HF_TOKEN": TOKEN})
    assert proc.returncode == 0, proc.stderr
    assert "model.safetensors" in proc.stdout and "private" in proc.stdout and f"base_model: {BASE}" in proc.stdout
    assert TOKEN not in proc.stdout + proc.stderr


def test_cli_offline_push_is_one_line(folder):
    proc = cli("push", folder, "--repo", REPO, cwd=folder.parent, env={"HF_TOKEN": TOKEN})
    assert_one_line_error(proc, "HF_HUB_OFFLINE", "--dry-run")
    assert TOKEN not in proc.stdout + proc.stderr


# -- only the folder's own files go up, and the plan is exactly what is sent ------------------------


OTHERS_TOKEN = "hf_" + "SomebodyElses0123456789abcdefghij"  # shaped like a Hub token, not the user's


@pytest.fixture
def secret(tmp_path) -> Path:
    """A private file beside the checkpoint, which a link in the folder might point to."""
    path = tmp_path / "id_ed25519"
    path.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    return path


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "push"])
@pytest.mark.parametrize("kind", ["file", "folder", "relative", "chained", "broken"])
def test_a_link_pointing_outside_is_refused_before_any_request(hub, folder, secret, capsys, dry_run, kind):
    target, resolved = {
        "file": (secret, secret),
        "folder": (secret.parent, secret.parent),  # the folder's own parent: a loop, too, if it were followed
        "relative": (Path("../..") / secret.name, secret),
        "chained": (folder / "zz-link", secret),  # inside, but that link points on outside
        "broken": (secret.parent / "nothing-here", secret.parent / "nothing-here"),
    }[kind]
    if kind == "chained":
        (folder / "zz-link").symlink_to(secret)
    (folder / "sub").mkdir()
    (folder / "sub" / "key").symlink_to(target)
    proc = run(capsys, "push", folder, "--repo", REPO, *(["--dry-run"] if dry_run else []))
    assert_one_line_error(proc, f"the link sub/key in {folder} points outside it, to {os.path.realpath(resolved)}:")
    assert hub.requests == []


def test_a_link_outside_in_a_left_out_path_stays_behind(hub, folder, tmp_path, capsys):
    """Training state on a scratch disk, linked in: left out without --include-training, refused with it."""
    scratch = tmp_path / "scratch"
    shutil.copytree(folder / "training", scratch)
    shutil.rmtree(folder / "training")
    (folder / "training").symlink_to(scratch)
    proc = run(capsys, "push", folder, "--repo", REPO)
    assert proc.returncode == 0, proc.stderr
    _, files = hub.commit()
    assert set(files) == MODEL_FILES
    proc = run(capsys, "push", folder, "--repo", REPO, "--include-training")
    assert_one_line_error(proc, "the link training in", str(scratch))


def test_links_inside_go_as_listed_and_a_loop_ends(hub, folder, capsys):
    """A link to a file inside goes as that file; linked folders (a loop among them) are left out, not followed."""
    (folder / "notes [v1]*.md").write_text("my notes\n")  # fnmatch's wildcards in a name: matched literally
    (folder / "alias.md").symlink_to("notes [v1]*.md")
    (folder / "loop").symlink_to(".")
    (folder / "sub").mkdir()
    (folder / "sub" / "up").symlink_to("..")
    (folder / "training-link").symlink_to(folder / "training")
    plan = push(folder, REPO, dry_run=True)
    listed = {path for path, _ in plan.files}
    assert listed == MODEL_FILES | {"notes [v1]*.md", "alias.md"}
    assert {"loop", "sub/up", "training-link"} <= set(plan.ignored)
    proc = run(capsys, "push", folder, "--repo", REPO)
    assert proc.returncode == 0, proc.stderr
    _, files = hub.commit()
    assert set(files) == listed
    assert files["alias.md"] == b"my notes\n"


# -- a token is never published, and a dry run checks that too ---------------------------------------


def _metadata_weights(path: Path, metadata: dict) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(path), metadata=metadata)


def _escaped_metadata_weights(path: Path) -> None:
    """A header written by hand, the token's first letter as a JSON escape: a byte search would miss it."""
    value = "\\u0068" + TOKEN[1:]
    header = f'{{"__metadata__": {{"note": "{value}"}}, "w": {{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}}}'
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(4))


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda p: (p / "README.md").write_text(f"token: {TOKEN}\n"), "README.md contains your Hub token"),
        (lambda p: (p / "metrics.jsonl").write_text(f"{OTHERS_TOKEN}\n"), "metrics.jsonl contains a Hub access token"),
        (lambda p: _metadata_weights(p / "extra.safetensors", {"hub": TOKEN}), "extra.safetensors contains your"),
        (lambda p: _metadata_weights(p / "model.safetensors", {"t": OTHERS_TOKEN}), "model.safetensors contains a Hub"),
        (lambda p: _escaped_metadata_weights(p / "extra.safetensors"), "extra.safetensors contains your"),
    ],
    ids=["own-in-card", "other-in-metrics", "own-in-extra-metadata", "other-in-weights-metadata", "escaped-metadata"],
)
def test_dry_run_refuses_a_token_in_the_files(hub, folder, capsys, damage, needle):
    damage(folder)
    proc = run(capsys, "push", folder, "--repo", REPO, "--dry-run")
    line = assert_one_line_error(proc, needle)
    assert TOKEN not in line and OTHERS_TOKEN not in line
    assert hub.requests == []


def test_dry_run_without_a_login_still_finds_a_token(hub, folder, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    (folder / "recipe.yaml").write_text(f"# HF_TOKEN={TOKEN}\n")
    assert_one_line_error(run(capsys, "push", folder, "--repo", REPO, "--dry-run"), "contains a Hub access token")


def test_the_token_scan_reads_the_cached_login_without_a_request(hub, folder, capsys, monkeypatch, tmp_path):
    """get_token() may exchange an OIDC token over the network: a dry run reads HF_TOKEN or the login file."""
    monkeypatch.delenv("HF_TOKEN")
    (tmp_path / "token").write_text("my-old-style-secret-token\n")  # not shaped like hf_…: found as the user's
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    monkeypatch.setenv("HF_OIDC_RESOURCE", REPO)  # get_token() would raise: no OIDC id token here
    assert run(capsys, "push", folder, "--repo", REPO, "--dry-run").returncode == 0
    (folder / "metrics.jsonl").write_text('{"token": "my-old-style-secret-token"}\n')
    assert_one_line_error(run(capsys, "push", folder, "--repo", REPO, "--dry-run"), "contains your Hub token")
    assert hub.requests == []


def test_a_token_cut_between_two_reads_is_found():
    from deltafy.hub.plan import _token_in

    head, tail = TOKEN[:10].encode(), TOKEN[10:].encode()
    assert _token_in([b"x" * 100 + head, tail + b"y"], TOKEN) == "yours"
    assert _token_in([b"x " + head, tail], None) == "token"
    assert _token_in([b"hf_short", b"and not a token " * 10], None) is None
    assert _token_in([b"xhf_" + b"a" * 40], None) is None  # inside a longer word: not a token's start


# -- the revision ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("a b", "space"),
        ("..x", ".."),
        ("-x", "starts with -"),
        ("x.lock", ".lock"),
        ("a/.hidden", "starts with ."),
        ("x.", "ends with ."),
        ("a//b", "//"),
        ("/a", "starts or ends with /"),
        ("a/", "starts or ends with /"),
        ("a@{1}", "@{"),
        ("@", "names no branch"),
        ("HEAD", "names no branch"),
        ("a~1", "~"),
        ("a^", "^"),
        ("a:b", ":"),
        ("a?", "?"),
        ("a*", "*"),
        ("a[1]", "["),
        ("a\\b", "\\"),
        ("a\tb", "control character"),
        ("a\x7fb", "control character"),
        ("", "empty"),
        ("refs/pr/x", "pull request number"),
    ],
)
def test_a_bad_branch_name_is_named(name, why):
    from deltafy.hub.plan import branch_name_problems

    assert any(why in problem for problem in branch_name_problems(name)), branch_name_problems(name)


@pytest.mark.parametrize("name", ["main", "ddl-heads", "feature/x.y", "v1.0", "ü-branch", "a@b", "refs/pr/12"])
def test_a_good_revision_passes(name):
    from deltafy.hub.plan import check_revision

    check_revision(name)


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "push"])
def test_a_bad_revision_is_one_line_before_any_request(hub, folder, capsys, dry_run):
    proc = run(capsys, "push", folder, "--repo", REPO, "--revision", "a b\nc", *(["--dry-run"] if dry_run else []))
    assert_one_line_error(proc, "--revision 'a b\\nc' is not a valid branch name: ", "space", "control character")
    assert hub.requests == []


def test_push_to_a_pull_request_creates_no_branch(hub, folder, capsys):
    proc = run(capsys, "push", folder, "--repo", REPO, "--revision", "refs/pr/1")
    assert proc.returncode == 0, proc.stderr
    assert not any("/branch/" in p for p in hub.paths())
    assert hub.paths()[-1] == f"/api/models/{REPO}/commit/refs/pr/1"
    assert "(pull request refs/pr/1)" in proc.stdout
