"""deltafy.data: finding, reading, tokenizing, caching and packing training text."""

from __future__ import annotations

import gzip
import json
import os

import pytest
import torch
from helpers.training import shared_tokenizer

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
        corpus / "a" / "rows.csv": "text\nc\n",
        corpus / "a" / "skip.bin": "x",
        corpus / "a" / "b" / "skip.py": "x",
    }
    for path, text in files.items():
        path.write_text(text)
    wanted = sorted(str(p) for p in files if p.suffix in (".txt", ".md", ".jsonl", ".rst", ".csv"))
    assert sorted(expand([str(corpus)])) == wanted  # recursive, files of text and of records only
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
    one_line_error(
        lambda: expand([str(tmp_path / "bare")]), "holds no text files (.txt, .md) or files of records (.jsonl, .json"
    )
    one_line_error(lambda: expand([str(tmp_path / "*.nothing")]), "no files match", "*.nothing")
    # something that exists but is neither (it was called "not found")
    one_line_error(lambda: expand([os.devnull]), f"{os.devnull} is not a file or a folder")


def test_a_path_that_exists_is_a_path_whatever_its_name(tmp_path, monkeypatch):
    names = ["notes [draft].txt", "what?.md", "a*b.txt", "[x].jsonl"]
    for name in names:
        (tmp_path / name).write_text('{"text": "t"}\n')
    for name in names:
        assert expand([str(tmp_path / name)]) == [str(tmp_path / name)]
    folder = tmp_path / "runs [v2]"  # a folder with brackets, globbed inside
    folder.mkdir()
    (folder / "one.txt").write_text("1")
    (folder / "two.md").write_text("2")
    assert expand([str(folder / "*.txt")]) == [str(folder / "one.txt")]
    assert expand([str(folder)]) == [str(folder / "one.txt"), str(folder / "two.md")]
    assert expand([str(tmp_path / "[w]hat?.md")]) == [str(tmp_path / "what?.md")]  # a glob when no such file
    monkeypatch.chdir(tmp_path)
    assert expand(["./notes [draft].txt"]) == ["./notes [draft].txt"]  # as typed
    one_line_error(lambda: expand(["nope[/]x.txt"]), "no files match nope[/]x.txt")


def test_unicode_paths_with_spaces(tmp_path, tok, cache):
    folder = tmp_path / "données d'été" / "jeu de données"
    folder.mkdir(parents=True)
    text = folder.parent / "naïve résumé — 夏.txt"
    text.write_text("Café crème")
    _save_dataset(folder / "ds ü", ["naïve"])
    stream = token_stream([str(text), str(folder / "ds ü")], tok)
    assert stream.tolist() == ids(tok, "Café crème") + [tok.eos_token_id] + ids(tok, "naïve") + [tok.eos_token_id]
    sources = sorted(json.loads(p.read_text(encoding="utf-8"))["source"] for p in cache.glob("*.json"))
    assert sources == sorted([str(text), str(folder / "ds ü")])
    bad = folder / "latin [1].txt"
    bad.write_bytes("Café".encode("latin-1"))
    one_line_error(lambda: token_stream([str(bad)], tok), f"{bad} is not UTF-8 text")


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


def test_json_csv_tsv_and_parquet_files_are_records_whose_text_field_is_a_document(tmp_path):
    # they were read as text: a .json array's brackets, keys and quotes were trained on, and a .csv's header
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": 'first, "quoted"', "body": "uno"}, {"text": "second\nline", "body": "dos"}]
    (tmp_path / "array.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "lines.json").write_text("\n".join(map(json.dumps, rows)) + "\n")  # JSON Lines named .json
    (tmp_path / "one.json").write_text(json.dumps(rows[0]))
    (tmp_path / "rows.csv").write_text(
        'body,text\nuno,"first, ""quoted"""\ndos,"second\nline"\n,\n'
    )  # (an empty row: no document)
    (tmp_path / "rows.tsv").write_text('text\tbody\nfirst, "quoted"\tuno\n')
    pq.write_table(pa.table({"body": ["uno", "dos"], "text": [r["text"] for r in rows]}), tmp_path / "rows.parquet")
    both = ['first, "quoted"', "second\nline"]
    for name in ("array.json", "lines.json", "rows.csv", "rows.parquet"):
        assert list(documents(str(tmp_path / name))) == both, name
        assert list(documents(str(tmp_path / name), text_field="body")) == ["uno", "dos"], name
    assert list(documents(str(tmp_path / "one.json"))) == both[:1]
    assert list(documents(str(tmp_path / "rows.tsv"))) == both[:1]
    long = "x" * 200_000  # past the csv module's default field limit of 128 KiB
    (tmp_path / "long.csv").write_text(f"text\n{long}\n")
    assert list(documents(str(tmp_path / "long.csv"))) == [long]


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


def test_byte_order_marks_and_unicode_line_separators(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "bom.jsonl").write_bytes(bom + b'{"text": "first"}\r\n{"text": "second"}\r\n')
    assert list(documents(str(tmp_path / "bom.jsonl"))) == ["first", "second"]
    (tmp_path / "bom.txt").write_bytes(bom + POEM.encode())
    assert list(documents(str(tmp_path / "bom.txt"))) == [POEM]
    # JSON strings may hold U+2028 and U+0085 unescaped: they end no line.
    (tmp_path / "seps.jsonl").write_text(
        json.dumps({"text": "one\u2028two\x85three"}, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    assert list(documents(str(tmp_path / "seps.jsonl"))) == ["one\u2028two\x85three"]


def test_datasets_dict_folder_is_one_input(tmp_path):
    import datasets

    folder = tmp_path / "dsdict"
    splits = {"validation": ["v"], "train": ["t"]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(
        str(folder)
    )
    assert expand([str(folder)]) == [str(folder)]
    assert list(documents(expand([str(folder)])[0])) == ["t"]  # its train split


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
    one_line_error(
        lambda: split_held_out(torch.zeros(2, 4), 0.9, seed=0),
        "only 2 blocks",
        "too few to hold out",
        "shorter --seq-len",
    )
    one_line_error(lambda: split_held_out(torch.zeros(1, 4), 0.05, seed=0), "only 1 block of text")
    for fraction in (0.0, 1.0, 1.5):
        one_line_error(lambda f=fraction: split_held_out(torch.zeros(10, 4), f, seed=0), "between 0 and 1")


# -- the token cache -------------------------------------------------------------------------------


def test_token_cache_is_written_read_and_keyed_by_content(tmp_path, tok, cache):
    path = tmp_path / "poem.txt"
    path.write_text(POEM)
    first = token_stream([str(path)], tok)
    files = list(cache.glob("*.pt"))
    assert len(files) == 1
    assert torch.equal(torch.load(files[0]), first)
    about = json.loads(files[0].with_suffix(".json").read_text())  # what the entry came from
    assert (about["source"], about["kind"], about["tokens"]) == (str(path.resolve()), "text", len(first))

    # A second call reads the cache, not the file: plant a different stream in the cache file.
    planted = torch.tensor([7, 7, 7], dtype=torch.int32)
    torch.save(planted, files[0])
    assert torch.equal(token_stream([str(path)], tok), planted)
    assert torch.equal(token_stream([str(path)], tok, use_cache=False), first)  # bypassed on request

    # The key is the bytes: a new modification time, or the same bytes at another path, still hit.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert torch.equal(token_stream([str(path)], tok), planted)
    (tmp_path / "elsewhere").mkdir()
    copy = tmp_path / "elsewhere" / "copy.md"
    copy.write_text(POEM)
    assert torch.equal(token_stream([str(copy)], tok), planted)
    assert len(list(cache.glob("*.pt"))) == 1

    # New content is read afresh.
    path.write_text(POEM + "Rough winds do shake the darling buds of May,\n")
    changed = token_stream([str(path)], tok)
    assert changed.tolist() == ids(tok, path.read_text()) + [tok.eos_token_id]
    assert len(list(cache.glob("*.pt"))) == 2


def test_same_size_edit_with_the_mtime_put_back_is_read_afresh(tmp_path, tok, cache):
    # What `cp -p`, `rsync -a` and `tar x` do: other bytes, same size, same modification time.
    path = tmp_path / "notes.txt"
    path.write_text("Shall I compare thee")
    stat = path.stat()
    assert token_stream([str(path)], tok).tolist() == ids(tok, "Shall I compare thee") + [tok.eos_token_id]
    path.write_text("Thou art more lovely")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    assert token_stream([str(path)], tok).tolist() == ids(tok, "Thou art more lovely") + [tok.eos_token_id]


def _save_dataset(folder, texts):
    import datasets

    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(folder))


def test_two_projects_each_with_their_own_ds_folder(tmp_path, tok, cache, monkeypatch):
    texts = {"a": [POEM] * 4, "b": ["To be, or not to be, that is the question"] * 9}
    for project, docs in texts.items():
        _save_dataset(tmp_path / project / "ds", docs)
    for project, docs in texts.items():
        monkeypatch.chdir(tmp_path / project)  # the same argument, `ds`, in each project
        expected = [i for doc in docs for i in ids(tok, doc) + [tok.eos_token_id]]
        assert token_stream(["ds"], tok).tolist() == expected
        assert token_stream(["ds"], tok).tolist() == expected  # and from the cache
    sources = sorted(json.loads(p.read_text())["source"] for p in cache.glob("*.json"))
    assert sources == [str(tmp_path / "a" / "ds"), str(tmp_path / "b" / "ds")]


def test_a_regenerated_ds_folder_is_read_afresh(tmp_path, tok, cache):
    import shutil

    folder = tmp_path / "ds"
    _save_dataset(folder, [POEM] * 40)
    assert len(pack(token_stream([str(folder)], tok), 64)) > 10
    shutil.rmtree(folder)
    _save_dataset(folder, ["To be", "or not", "to be"])  # three short documents
    stream = token_stream([str(folder)], tok)
    assert stream.tolist() == [i for d in ("To be", "or not", "to be") for i in ids(tok, d) + [tok.eos_token_id]]
    one_line_error(lambda: pack(stream, 64), f"only {len(stream)} tokens")


def test_token_cache_is_keyed_by_text_field_and_reader(tmp_path, tok, cache):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "first", "title": "one"}\n')
    assert token_stream([str(path)], tok).tolist() == ids(tok, "first") + [tok.eos_token_id]
    assert token_stream([str(path)], tok, text_field="title").tolist() == ids(tok, "one") + [tok.eos_token_id]
    # The same bytes as a text file are one document: the whole line, braces and all.
    as_text = tmp_path / "docs.txt"
    as_text.write_bytes(path.read_bytes())
    assert token_stream([str(as_text)], tok).tolist() == ids(tok, as_text.read_text()) + [tok.eos_token_id]
    assert len(list(cache.glob("*.pt"))) == 3


def test_token_cache_is_keyed_by_the_whole_tokenizer(tmp_path, tok, cache):
    from tokenizers import Tokenizer, normalizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "a.txt"
    path.write_text("SHALL I COMPARE THEE")
    before = token_stream([str(path)], tok)

    # The same vocabulary and merges, with a normalizer in front: other ids for the same text.
    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.normalizer = normalizers.Lowercase()
    lower = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    assert lower.get_vocab() == tok.get_vocab()
    assert token_stream([str(path)], lower).tolist() == ids(lower, "shall i compare thee") + [lower.eos_token_id]

    other = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<eos>")
    other.add_tokens(["COMPARE"])  # an added token must not reuse the first tokenizer's ids
    assert other.convert_tokens_to_ids("COMPARE") in token_stream([str(path)], other).tolist()
    assert len(list(cache.glob("*.pt"))) == 3
    assert "COMPARE" not in tok.get_vocab()  # the shared tokenizer was left alone
    assert torch.equal(token_stream([str(path)], tok), before)


def test_hub_dataset_key_follows_the_revision_it_loaded(tmp_path, tok):
    import datasets

    from deltafy.data import _hub_identity, _key

    # `datasets` fingerprints a Hub dataset by the files it resolved; local files stand in for them.
    (tmp_path / "v1.jsonl").write_text('{"text": "first"}\n')
    (tmp_path / "v2.jsonl").write_text('{"text": "second"}\n')
    loads = {
        v: datasets.load_dataset(
            "json", data_files=str(tmp_path / f"{v}.jsonl"), split="train", cache_dir=str(tmp_path)
        )
        for v in ("v1", "v2")
    }
    keys = {v: _key(_hub_identity("user/corpus", data, "text"), "tok") for v, data in loads.items()}
    assert keys["v1"] != keys["v2"]
    assert keys["v1"] == _key(_hub_identity("user/corpus", loads["v1"], "text"), "tok")
    assert keys["v1"] != _key(_hub_identity("user/other", loads["v1"], "text"), "tok")
    assert keys["v1"] != _key(_hub_identity("user/corpus", loads["v1"], "body"), "tok")


def test_a_damaged_or_unwritable_cache_costs_a_tokenization_not_the_run(tmp_path, tok, cache, monkeypatch, caplog):
    path = tmp_path / "poem.txt"
    path.write_text(POEM)
    fresh = token_stream([str(path)], tok, use_cache=False)
    token_stream([str(path)], tok)
    (entry,) = cache.glob("*.pt")
    entry.write_bytes(b"not a tensor")
    assert torch.equal(token_stream([str(path)], tok), fresh)  # re-tokenized and replaced
    assert torch.equal(torch.load(entry), fresh)

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("DELTAFY_CACHE", str(blocked))  # the cache folder cannot be created
    with caplog.at_level("WARNING"):
        assert torch.equal(token_stream([str(path)], tok), fresh)
    assert "could not cache the tokens" in caplog.text


def test_fingerprint_is_stable_and_follows_content(tmp_path, tok, cache):
    from transformers import AutoTokenizer

    from deltafy.data import fingerprint

    a, b = tmp_path / "a.txt", tmp_path / "b.jsonl"
    a.write_text(POEM)
    b.write_text('{"text": "first", "title": "one"}\n')
    _save_dataset(tmp_path / "ds", ["alpha", "beta"])
    sources = [str(a), str(b), str(tmp_path / "ds")]
    fp = fingerprint(sources, tok)
    assert fp == fingerprint(sources, tok)
    tok.save_pretrained(tmp_path / "tok")
    assert fp == fingerprint(sources, AutoTokenizer.from_pretrained(tmp_path / "tok"))  # the same tokenizer, reloaded
    assert not cache.exists()  # nothing was tokenized, nothing cached

    (tmp_path / "moved").mkdir()
    (tmp_path / "moved" / "a.txt").write_bytes(a.read_bytes())
    assert fingerprint([str(tmp_path / "moved" / "a.txt"), *sources[1:]], tok) == fp  # the bytes, not the path
    assert fingerprint(sources[::-1], tok) != fp  # the order of the stream
    assert fingerprint(sources, tok, text_field="title") != fp
    stat = a.stat()
    a.write_text(POEM.replace("summer", "winter"))  # same size
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprint(sources, tok) != fp


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
        "text.txt.gz": (gzip.compress(b"text"), "text.txt.gz is compressed (.gz); decompress it first"),
        "latin1.txt": ("Café crème, señor".encode("latin-1"), "is not UTF-8"),
        "bad.jsonl": (b'{"text": "ok"}\n{"text": oops}\n', "bad.jsonl:2 is not valid JSON"),
        "nofield.jsonl": (b'{"text": "ok"}\n{"body": "x"}\n', "nofield.jsonl:2 has no string field 'text'"),
        "notstring.jsonl": (b'{"text": 3}\n', "has no string field 'text'"),
        "array.jsonl": (b'["text"]\n', "has no string field 'text'"),
        "bad.json": (b'[{"text": "ok"},\n', "bad.json is not valid JSON (Expecting value at line 2, column 1)"),
        "strings.json": (b'["ok", "no"]', "strings.json: record 0 has no string field 'text' (set --text-field)"),
        "scalar.json": (b"42", "scalar.json has no string field 'text'"),
        "nocolumn.csv": (b"a,b\n1,2\n", "nocolumn.csv has no column 'text' (set --text-field); its columns: a, b"),
        "empty.csv": (b"", "empty.csv has no column 'text' (set --text-field); its columns: none"),
        "broken.parquet": (b"PAR1" + bytes(64) + b"PAR1", "broken.parquet as Parquet: "),
    }
    for name, (raw, needle) in cases.items():
        path = tmp_path / name
        path.write_bytes(raw)
        one_line_error(lambda p=path: token_stream([str(p)], tok), needle)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "numbers.parquet")
    one_line_error(
        lambda: token_stream([str(tmp_path / "numbers.parquet")], tok), "column 'text' holds int64, not text"
    )
    _save_dataset(tmp_path / "ds", ["a text"])
    one_line_error(
        lambda: token_stream([str(tmp_path / "ds")], tok, text_field="body"),
        f"dataset {tmp_path / 'ds'} has no column 'body' (set --text-field); its columns: text",
    )
    one_line_error(lambda: token_stream([str(tmp_path / "missing.txt")], tok), "data not found")
    (tmp_path / "empty-folder").mkdir()
    one_line_error(lambda: token_stream([str(tmp_path / "empty-folder")], tok), "holds no text files")
    # an empty path (an unset variable: --data "$DATA") is not the current folder
    for empty in ("", "  "):
        one_line_error(lambda e=empty: token_stream([e], tok), "an empty path was given as text to read")


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


def test_held_out_text_that_is_trained_on_is_refused_under_any_name(tmp_path):
    import datasets

    from deltafy.data import refuse_shared_text

    (tmp_path / "a.txt").write_text("the same words")
    (tmp_path / "copy.txt").write_text("the same words")
    (tmp_path / "other.txt").write_text("other words")
    (tmp_path / "link.txt").symlink_to(tmp_path / "a.txt")
    splits = {name: datasets.Dataset.from_dict({"text": [name]}) for name in ("train", "test")}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "ds"))
    a, ds = str(tmp_path / "a.txt"), str(tmp_path / "ds")
    for trained, held in [
        (a, str(tmp_path / "copy.txt")),
        (a, str(tmp_path / "link.txt")),
        (ds, f"{ds}/train"),  # a folder of splits is read as its train split
        (f"{ds}/train", f"{tmp_path}/./ds"),
        ("someone/corpus", "someone/corpus"),
    ]:
        one_line_error(
            lambda t=trained, h=held: refuse_shared_text([t], [h]),
            f"--eval-data {held} holds the same text as --data {trained}",
        )
    refuse_shared_text([a, ds], [str(tmp_path / "other.txt"), f"{ds}/test", "someone/other"])
