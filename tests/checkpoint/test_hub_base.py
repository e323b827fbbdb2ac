"""Heads-only checkpoints whose base lives on the Hub, through huggingface_hub's real download code.

The Hub is served in-process: huggingface_hub sends every request through the client its factory
makes, and the factory installed here gives one whose transport answers as the Hub does (the
resolve routes of ``hf_hub_download`` with their commit, etag and size headers, and the model-info
API that resolves a branch to a commit) and records each request, so the tests see what was asked
for and at which revision.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import httpx2
import huggingface_hub
import pytest
import torch
import transformers.dynamic_module_utils
from helpers.models import fixed_ids, randomize_heads, tiny_model
from huggingface_hub import constants
from huggingface_hub.utils._http import default_client_factory, hf_request_event_hook

import deltafy

BASE = "someone/tiny-llama"
BASE_COMMIT = "0123456789abcdef0123456789abcdef01234567"
HEADS = "me/smol-ddl"
HEADS_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<file>.+)")
INFO = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<revision>[^/]+))?")
TREE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<revision>[^/]+)")  # snapshot_download's listing


class FakeHub:
    """An httpx transport handler serving model repos (one commit each, also answering as ``main``)."""

    def __init__(self):
        self.repos: dict[str, SimpleNamespace] = {}
        self.requests: list[SimpleNamespace] = []

    def serve(self, repo: str, folder: Path, commit: str) -> None:
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        self.repos[repo] = SimpleNamespace(commit=commit, answer_commit=commit, files=files, status=None)

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        if path.endswith("-harnesses"):  # huggingface_hub's own once-a-day telemetry registry fetch, best effort
            return httpx2.Response(404)
        self.requests.append(SimpleNamespace(method=request.method, path=path))
        if match := RESOLVE.fullmatch(path):
            return self._resolve(request, **match.groupdict())
        if match := TREE.fullmatch(path):
            repo = self.repos.get(match["repo"])
            if repo is None or repo.status:
                return self._refused(repo)
            listing = [
                {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in sorted(repo.files.items())
            ]
            return httpx2.Response(200, json=listing)
        if match := INFO.fullmatch(path):
            repo = self.repos.get(match["repo"])
            if repo is None or repo.status:
                return self._refused(repo)
            siblings = [{"rfilename": name} for name in sorted(repo.files)]
            return httpx2.Response(200, json={"id": match["repo"], "sha": repo.answer_commit, "siblings": siblings})
        return httpx2.Response(404, json={"error": f"no route {path}"})

    def _refused(self, repo) -> httpx2.Response:
        # As the Hub answers an unknown or private repo, or one the token may not read.
        status = repo.status if repo is not None else 404
        headers = {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}
        return httpx2.Response(status, headers=headers, json={"error": "Repository not found"})

    def _resolve(self, request, repo: str, revision: str, file: str) -> httpx2.Response:
        served = self.repos.get(repo)
        if served is None or served.status:
            return self._refused(served)
        if revision not in (served.commit, "main"):
            headers = {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}
            return httpx2.Response(404, headers=headers, json={"error": "Invalid rev id"})
        commit = {"X-Repo-Commit": served.answer_commit}
        if file not in served.files:
            headers = commit | {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"}
            return httpx2.Response(404, headers=headers, json={"error": "Entry not found"})
        content = served.files[file]
        headers = commit | {
            "ETag": f'"{hashlib.sha256(content).hexdigest()}"',
            "Content-Length": str(len(content)),
            "Content-Type": "application/octet-stream",
        }
        return httpx2.Response(200, headers=headers, content=b"" if request.method == "HEAD" else content)

    def paths(self, repo: str) -> list[str]:
        return [r.path for r in self.requests if f"/{repo}/" in r.path + "/"]


def go_offline(monkeypatch, offline: bool) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    # read once, when huggingface_hub is imported; transformers asks huggingface_hub's is_offline_mode()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The fake Hub, online, with a cache of its own for this test."""
    home = tmp_path / "hf-home"
    for var, value in (("HF_HOME", home), ("HF_HUB_CACHE", home / "hub"), ("HF_MODULES_CACHE", home / "modules")):
        monkeypatch.setenv(var, str(value))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    # where remote code is copied and imported from: read by transformers at import time
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(home / "modules"))
    go_offline(monkeypatch, False)
    recorder = FakeHub()
    hooks = {"request": [hf_request_event_hook]}  # the real client's hook: where offline mode is enforced
    transport = httpx2.MockTransport(recorder)
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=transport, event_hooks=hooks))
    yield recorder
    huggingface_hub.set_client_factory(default_client_factory)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny llama as published on the Hub, converted with heads that matter, saved both ways."""
    root = tmp_path_factory.mktemp("hub-base")
    stock = root / "stock"
    tiny_model("llama-untied").save_pretrained(stock)
    model = deltafy.convert(transformers.AutoModelForCausalLM.from_pretrained(stock).eval())
    randomize_heads(model)
    provenance = {"kind": "hub", "source": BASE, "revision": BASE_COMMIT}  # as converted from the Hub
    heads = deltafy.save(model, root / "heads", heads_only=True, base=BASE, provenance=provenance)
    full = deltafy.save(model, root / "full")
    ids = fixed_ids(model)
    with torch.no_grad():
        logits = deltafy.load(full)(input_ids=ids).logits
        assert (logits - tiny_model("llama-untied")(input_ids=ids).logits).abs().max() > 1e-2, "the heads must matter"
    return SimpleNamespace(stock=stock, heads=heads, full=full, ids=ids, logits=logits)


def logits_of(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def at_revisions(paths: list[str]) -> set[str]:
    """The revisions that resolve requests asked for."""
    return {m["revision"] for p in paths if (m := RESOLVE.fullmatch(p))}


def test_local_heads_folder_loads_its_pinned_base_from_the_hub(hub, made):
    hub.serve(BASE, made.stock, BASE_COMMIT)
    loaded = deltafy.load(made.heads)
    assert torch.equal(logits_of(loaded, made.ids), made.logits)
    paths = hub.paths(BASE)
    assert f"/{BASE}/resolve/{BASE_COMMIT}/model.safetensors" in paths
    assert at_revisions(paths) == {BASE_COMMIT} and len(paths) == len(hub.requests)
    # Plain transformers, running the folder's own code, gives the same model (from the cache now).
    plain = transformers.AutoModelForCausalLM.from_pretrained(made.heads, trust_remote_code=True)
    assert type(plain).__name__ == "DeltafyForCausalLM"
    assert torch.equal(logits_of(plain, made.ids), made.logits)


# transformers passes the checkpoint's own adapter lookup (adapter_kwargs, with the checkpoint's
# revision: None for a folder, its commit for a Hub repo) down to the class's from_pretrained, and
# _from_base forwards it to the base's loading, which then asks the base repo at that revision.
def test_plain_transformers_asks_the_base_only_at_the_pinned_revision(hub, made):
    hub.serve(BASE, made.stock, BASE_COMMIT)
    plain = transformers.AutoModelForCausalLM.from_pretrained(made.heads, trust_remote_code=True)
    assert torch.equal(logits_of(plain, made.ids), made.logits)
    assert at_revisions(hub.paths(BASE)) == {BASE_COMMIT}  # today also HEAD .../resolve/main/adapter_config.json


def test_heads_repo_on_the_hub_loads_with_its_pinned_base(hub, made):
    hub.serve(BASE, made.stock, BASE_COMMIT)
    hub.serve(HEADS, made.heads, HEADS_COMMIT)
    model = transformers.AutoModelForCausalLM.from_pretrained(HEADS, trust_remote_code=True)
    assert torch.equal(logits_of(model, made.ids), made.logits)
    paths = [r.path for r in hub.requests]
    assert paths[0] == f"/api/models/{HEADS}"  # main resolved to the heads repo's commit once
    assert at_revisions(hub.paths(HEADS)) == {HEADS_COMMIT} and at_revisions(hub.paths(BASE)) == {BASE_COMMIT}
    order = [p for p in paths if p.endswith(("/config.json", "/model.safetensors", "/deltafy_heads.safetensors"))]
    assert order[0].startswith(f"/{HEADS}/") and order[-1].endswith("/deltafy_heads.safetensors")
    assert f"/{BASE}/resolve/{BASE_COMMIT}/model.safetensors" in order


def assert_base_error(err, *also: str) -> None:
    message = str(err.value)
    assert "\n" not in message
    for part in (BASE, BASE_COMMIT, *also):
        assert part in message, message


@pytest.mark.parametrize("refusal", ["404", "401", "commit gone"])
def test_base_the_hub_refuses_is_one_line(hub, made, refusal):
    if refusal == "commit gone":  # history rewritten: the repo is there, the pinned commit is not
        hub.serve(BASE, made.stock, OTHER_COMMIT)
    else:
        hub.serve(BASE, made.stock, BASE_COMMIT)
        hub.repos[BASE].status = int(refusal)
    with pytest.raises(deltafy.DeltafyError) as err:
        deltafy.load(made.heads)
    assert_base_error(err)
    assert hub.paths(BASE), "the Hub was asked"
    # Plain transformers gets the same line (an OSError raised by the folder's own code).
    with pytest.raises(OSError) as err:
        transformers.AutoModelForCausalLM.from_pretrained(made.heads, trust_remote_code=True)
    assert_base_error(err)


def test_base_served_at_another_commit_is_refused(hub, made):
    hub.serve(BASE, made.stock, BASE_COMMIT)
    hub.repos[BASE].answer_commit = OTHER_COMMIT  # asked for the pinned commit, the Hub answers with another
    with pytest.raises(deltafy.DeltafyError) as err:
        deltafy.load(made.heads)
    assert_base_error(err, OTHER_COMMIT)


def test_cached_base_loads_offline_without_a_request(hub, made, monkeypatch):
    hub.serve(BASE, made.stock, BASE_COMMIT)
    deltafy.load(made.heads)
    assert hub.paths(BASE)
    go_offline(monkeypatch, True)
    # No offline hook this time: any request at all would reach the fake Hub, and be counted.
    transport = httpx2.MockTransport(hub)
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=transport))
    hub.requests.clear()
    assert torch.equal(logits_of(deltafy.load(made.heads), made.ids), made.logits)
    plain = transformers.AutoModelForCausalLM.from_pretrained(made.heads, trust_remote_code=True)
    assert torch.equal(logits_of(plain, made.ids), made.logits)
    assert hub.requests == []


def test_convert_from_the_hub_pins_the_commit_it_loaded(hub, made, tmp_path):
    from deltafy.conversion.job import convert_source

    hub.serve(BASE, made.stock, BASE_COMMIT)
    out = convert_source(BASE, tmp_path / "delta", heads_only=True).out  # the Hub resolves main to BASE_COMMIT
    assert json.loads((out / "config.json").read_text())["deltafy"]["base"] == {"id": BASE, "revision": BASE_COMMIT}
    hub.requests.clear()
    deltafy.load(out)
    assert at_revisions(hub.paths(BASE)) <= {BASE_COMMIT}


def test_convert_streams_a_hub_model_from_the_cache(hub, made, tmp_path):
    # The shards are fetched into the HF cache (only what the index names: never *.bin or duplicates)
    # and hard-linked from there; the checkpoint is the in-memory conversion's, bitwise.
    import os

    from deltafy.conversion.job import convert_source

    hub.serve(BASE, made.stock, BASE_COMMIT)
    hub.repos[BASE].files["pytorch_model.bin"] = b"never fetched"
    result = convert_source(BASE, tmp_path / "streamed")
    assert result.shards == {"hard-linked": 1, "copied": 0, "cast": 0}
    fetched = {m["file"] for p in hub.paths(BASE) if (m := RESOLVE.fullmatch(p))}
    assert "model.safetensors" in fetched and "pytorch_model.bin" not in fetched
    blob = Path(constants.HF_HUB_CACHE) / "models--someone--tiny-llama" / "blobs"
    linked = os.stat(result.out / "model-00001-of-00002.safetensors").st_ino
    assert linked in {os.stat(b).st_ino for b in blob.iterdir()}
    provenance = json.loads((result.out / "config.json").read_text())["deltafy"]["provenance"]
    assert (provenance["kind"], provenance["source"], provenance["revision"]) == ("hub", BASE, BASE_COMMIT)
    local = convert_source(str(made.stock), tmp_path / "in-memory", streaming=False).out
    for a, b in zip(
        deltafy.load(result.out).state_dict().items(), deltafy.load(local).state_dict().items(), strict=True
    ):
        assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_a_hub_model_that_cannot_be_reached_is_one_line_after_one_request(hub, monkeypatch, tmp_path):
    """No network and nothing cached: load_source (convert in memory, eval, bench) says so after the one request
    that resolves the revision, where transformers' own loading retried the download for half a minute."""
    from deltafy.conversion.job import convert_source

    asked = []

    def unreachable(request):
        if not request.url.path.endswith("-harnesses"):  # (huggingface_hub's daily telemetry fetch, as above)
            asked.append(request.url.path)
        raise httpx2.ConnectError("[Errno -2] Name or service not known", request=request)

    transport = httpx2.MockTransport(unreachable)
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=transport))
    with pytest.raises(deltafy.DeltafyError) as err:
        convert_source(BASE, tmp_path / "delta", streaming=False)
    line = str(err.value)
    assert line.startswith(f"could not fetch {BASE!r} from the Hugging Face Hub") and "\n" not in line
    assert "could not be reached" in line and "check the id and your connection" in line
    assert asked == [f"/api/models/{BASE}"]  # the revision, once: no retried download
    assert not (tmp_path / "delta").exists()
    # a Hub dataset given to --data (train, eval, bench): the same, where `datasets` retried too
    from deltafy.data import _load_dataset

    asked.clear()
    with pytest.raises(deltafy.DeltafyError) as err:
        _load_dataset("someone/corpus")
    assert str(err.value).startswith("could not fetch the dataset someone/corpus from the Hugging Face Hub")
    assert asked == ["/api/datasets/someone/corpus"]


OFFLINE = "is not in the local Hugging Face cache and the Hub is offline"
PASS_BASE = "or pass its local folder with --base PATH (deltafy_base=PATH in Python)"


def test_an_uncached_base_while_offline_says_so_and_a_local_copy_loads(hub, made, monkeypatch):
    hub.serve(BASE, made.stock, BASE_COMMIT)
    go_offline(monkeypatch, True)
    with pytest.raises(deltafy.DeltafyError) as err:
        deltafy.load(made.heads)
    assert_base_error(err, OFFLINE, "(HF_HUB_OFFLINE is set)", PASS_BASE)
    with pytest.raises(OSError) as err:  # the folder's own code says the same
        transformers.AutoModelForCausalLM.from_pretrained(made.heads, trust_remote_code=True)
    assert_base_error(err, OFFLINE, "(HF_HUB_OFFLINE is set)", PASS_BASE)
    assert hub.requests == []
    # the base's folder given instead: no hashes to check it by, so its tensors must fill the model exactly
    assert torch.equal(logits_of(deltafy.load(made.heads, base=made.stock), made.ids), made.logits)
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        made.heads, trust_remote_code=True, deltafy_base=str(made.stock)
    )
    assert torch.equal(logits_of(plain, made.ids), made.logits)
    # online, but told to use only what is cached
    go_offline(monkeypatch, False)
    with pytest.raises(deltafy.DeltafyError) as err:
        deltafy.load(made.heads, local_files_only=True)
    assert_base_error(err, OFFLINE, "(local_files_only=True)", PASS_BASE)
    assert hub.requests == []
