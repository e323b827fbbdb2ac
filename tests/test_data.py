"""deltafy.data: finding, reading, tokenizing, caching and packing training text."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _train_helpers import shared_tokenizer

from deltafy.data import documents, expand, pack, split_held_out, token_stream
from deltafy.errors import DeltafyError

POEM = "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate.\n"


@pytest.fixture(scope="module")
def tok():
    return shared_tokenizer()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "deltafy-cache"
    monkeypatch.setenv("DELTAFY_CACHE", str(root))
    return root / "tokens"


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def one_line_error(call, *needles: str) -> str:
    with pytest.raises(DeltafyError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


# -- finding inputs ------------------------------------------------------------------------------


def test_expand_files_folders_and_globs(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "a" / "b").mkdir(parents=True)
    files = {
        corpus / "top.txt": "t",
        corpus / "a" / "mid.md": "m",
        corpus / "a" / "b" / "deep.jsonl": '{"text": "d"}',
        corpus / "a" / "b" / "notes.rst": "r",
        corpus / "a" / "skip.bin": "x",
        corpus / "a" / "b" / "skip.py": "x",
    }
    for path, text in files.items():
        path.write_text(text)
    wanted = sorted(str(p) for p in files if p.suffix in (".txt", ".md", ".jsonl", ".rst"))
    assert sorted(expand([str(corpus)])) == wanted  # recursive, text files only
    assert expand([str(corpus / "top.txt")]) == [str(corpus / "top.txt")]
    assert expand([str(corpus / "**" / "*.md")]) == [str(corpus / "a" / "mid.md")]  # recursive glob
    deep = corpus / "a" / "b"
    assert expand([str(deep / "*")]) == [str(deep / n) for n in ("deep.jsonl", "notes.rst", "skip.py")]  # as matched
    # Several inputs keep their order.
    assert expand([str(corpus / "top.txt"), str(corpus / "a" / "mid.md")]) == [
        str(corpus / "top.txt"),
        str(corpus / "a" / "mid.md"),
    ]


def test_expand_errors(tmp_path):
    one_line_error(lambda: expand([str(tmp_path / "missing.txt")]), "data not found", "missing.txt")
    one_line_error(lambda: expand(["./nowhere"]), "data not found")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "weights.bin").write_bytes(b"\x00")
    one_line_error(lambda: expand([str(tmp_path / "bare")]), "holds no .txt, .md or .jsonl files")
    one_line_error(lambda: expand([str(tmp_path / "*.nothing")]), "no files match")


# -- reading documents --------------------------------------------------------------------------


def test_text_and_markdown_files_are_one_document_each(tmp_path):
    (tmp_path / "a.txt").write_text(POEM)
    (tmp_path / "b.md").write_text("# Sonnet 18\n\n" + POEM)
    assert list(documents(str(tmp_path / "a.txt"))) == [POEM]
    assert list(documents(str(tmp_path / "b.md"))) == ["# Sonnet 18\n\n" + POEM]


def test_jsonl_lines_are_documents(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"text": "first", "body": "uno"}, {"text": "second", "body": "dos"}]
    path.write_text(json.dumps(rows[0]) + "\n\n   \n" + json.dumps(rows[1]) + "\n")  # blank lines skipped
    assert list(documents(str(path))) == ["first", "second"]
    assert list(documents(str(path), text_field="body")) == ["uno", "dos"]


def test_datasets_folder_saved_with_save_to_disk(tmp_path, tok):
    import datasets

    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"content": ["alpha beta", "gamma", "delta epsilon"], "n": [1, 2, 3]}).save_to_disk(
        str(folder)
    )
    assert expand([str(folder)]) == [str(folder)]  # the folder itself, not the arrow files inside
    assert list(documents(str(folder), text_field="content")) == ["alpha beta", "gamma", "delta epsilon"]
    stream = token_stream([str(folder)], tok, text_field="content")
    expected = ids(tok, "alpha beta") + [tok.eos_token_id] + ids(tok, "gamma") + [tok.eos_token_id]
    expected += ids(tok, "delta epsilon") + [tok.eos_token_id]
    assert stream.tolist() == expected
    one_line_error(lambda: list(documents(str(folder))), "no column 'text'", "content")

    dict_folder = tmp_path / "dsdict"
    splits = {"validation": ["v"], "train": ["t"]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(
        str(dict_folder)
    )
    assert list(documents(str(dict_folder))) == ["t"]  # a DatasetDict's train split


# -- token streams, EOS and packing -------------------------------------------------------------


def test_documents_are_separated_by_eos(tmp_path, tok):
    (tmp_path / "a.txt").write_text(POEM)
    (tmp_path / "b.jsonl").write_text('{"text": "To be"}\n{"text": "   "}\n{"text": "or not"}\n')
    stream = token_stream([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], tok)
    assert stream.dtype == torch.int32
    eos = tok.eos_token_id
    expected = ids(tok, POEM) + [eos] + ids(tok, "To be") + [eos] + ids(tok, "or not") + [eos]  # blank doc dropped
    assert stream.tolist() == expected
    assert stream.tolist().count(eos) == 3


def test_pack_drops_the_ragged_tail():
    stream = torch.arange(10, dtype=torch.int32)
    blocks = pack(stream, 3)
    assert blocks.dtype == torch.int64
    assert blocks.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert pack(stream, 5).tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    one_line_error(lambda: pack(stream, 11), "only 10 tokens", "--seq-len 11")


def test_split_held_out_is_reproducible_and_disjoint():
    blocks = torch.arange(40).view(20, 2)
    train, held = split_held_out(blocks, 0.25, seed=3)
    assert (len(train), len(held)) == (15, 5)
    rows = sorted(tuple(r) for r in torch.cat([train, held]).tolist())
    assert rows == sorted(tuple(r) for r in blocks.tolist())  # a partition of the blocks
    again = split_held_out(blocks, 0.25, seed=3)
    assert torch.equal(again[0], train) and torch.equal(again[1], held)
    assert not torch.equal(split_held_out(blocks, 0.25, seed=4)[1], held)


def test_held_out_errors():
    one_line_error(lambda: split_held_out(torch.zeros(2, 4), 0.9, seed=0), "only 2 blocks", "too few to hold out")
    one_line_error(lambda: split_held_out(torch.zeros(1, 4), 0.05, seed=0), "only 1 blocks")
    for fraction in (0.0, 1.0, 1.5):
        one_line_error(lambda f=fraction: split_held_out(torch.zeros(10, 4), f, seed=0), "between 0 and 1")


# -- the token cache -------------------------------------------------------------------------------


def test_token_cache_is_written_read_and_invalidated(tmp_path, tok, cache):
    path = tmp_path / "poem.txt"
    path.write_text(POEM)
    first = token_stream([str(path)], tok)
    files = list(cache.glob("*.pt"))
    assert len(files) == 1
    assert torch.equal(torch.load(files[0]), first)

    # A second call reads the cache, not the file: plant a different stream in the cache file.
    planted = torch.tensor([7, 7, 7], dtype=torch.int32)
    torch.save(planted, files[0])
    assert torch.equal(token_stream([str(path)], tok), planted)
    assert torch.equal(token_stream([str(path)], tok, use_cache=False), first)  # bypassed on request

    # A new modification time alone makes a new entry, even with the same bytes.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert torch.equal(token_stream([str(path)], tok), first)
    assert len(list(cache.glob("*.pt"))) == 2

    # New content is read afresh.
    path.write_text(POEM + "Rough winds do shake the darling buds of May,\n")
    changed = token_stream([str(path)], tok)
    assert changed.tolist() == ids(tok, path.read_text()) + [tok.eos_token_id]
    assert len(list(cache.glob("*.pt"))) == 3


def test_token_cache_is_keyed_by_text_field_and_tokenizer(tmp_path, tok, cache):
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "first", "title": "one"}\n')
    assert token_stream([str(path)], tok).tolist() == ids(tok, "first") + [tok.eos_token_id]
    assert token_stream([str(path)], tok, text_field="title").tolist() == ids(tok, "one") + [tok.eos_token_id]

    other = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<eos>")
    other.add_tokens(["first"])  # a different vocabulary must not reuse the first tokenizer's ids
    assert token_stream([str(path)], other).tolist() == [other.convert_tokens_to_ids("first"), other.eos_token_id]
    assert len(list(cache.glob("*.pt"))) == 3
    assert "first" not in tok.get_vocab()  # the shared tokenizer was left alone


def test_use_cache_false_writes_nothing(tmp_path, tok, cache):
    path = tmp_path / "poem.txt"
    path.write_text(POEM)
    token_stream([str(path)], tok, use_cache=False)
    assert not cache.exists() or not list(cache.iterdir())


# -- errors ------------------------------------------------------------------------------------------


def test_unreadable_inputs_are_one_line_errors(tmp_path, tok):
    cases = {
        "empty.txt": (b"", "holds no text"),
        "blank.md": (b"  \n\n\t\n", "holds no text"),
        "binary.txt": (b"some text\x00\x01\x02 more", "looks binary"),
        "latin1.txt": ("Café crème, señor".encode("latin-1"), "is not UTF-8"),
        "bad.jsonl": (b'{"text": "ok"}\n{"text": oops}\n', "bad.jsonl:2 is not valid JSON"),
        "nofield.jsonl": (b'{"text": "ok"}\n{"body": "x"}\n', "nofield.jsonl:2 has no string field 'text'"),
        "notstring.jsonl": (b'{"text": 3}\n', "has no string field 'text'"),
        "array.jsonl": (b'["text"]\n', "has no string field 'text'"),
    }
    for name, (raw, needle) in cases.items():
        path = tmp_path / name
        path.write_bytes(raw)
        one_line_error(lambda p=path: token_stream([str(p)], tok), needle)
    one_line_error(lambda: token_stream([str(tmp_path / "missing.txt")], tok), "data not found")
    (tmp_path / "empty-folder").mkdir()
    one_line_error(lambda: token_stream([str(tmp_path / "empty-folder")], tok), "holds no .txt")


def test_too_little_text_for_one_block(tmp_path, tok):
    path = tmp_path / "short.txt"
    path.write_text("To be")
    stream = token_stream([str(path)], tok)
    one_line_error(lambda: pack(stream, 64), f"only {len(stream)} tokens", "fewer than one block")


def test_tokenizer_without_eos(tmp_path, tok):
    from transformers import PreTrainedTokenizerFast

    no_eos = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)
    (tmp_path / "a.txt").write_text(POEM)
    one_line_error(lambda: token_stream([str(tmp_path / "a.txt")], no_eos), "no EOS token")
