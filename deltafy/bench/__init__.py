"""``deltafy bench``: DDL arms against LoRA, fairly. Every arm starts from one conversion of the same
source, trains on the same data in the same order for the same token budget at the best learning
rate of a small sweep (chosen on a share of the training text, never the reported held-out text),
over several seeds, and is reported on the same held-out text.

Layout of the bench folder: ``models/<recipe>/`` (the converted starting points), ``runs/<arm>/
lr-<m>x/`` (the sweep, seed 0, validated on the held-out share of ``data``), ``runs/<arm>/seed-<k>/``
(evaluated on ``eval_data``), ``bench.json`` (rewritten after every run: what resumes) and
``bench.png``. A sweep run keeps only its metrics and run record: its model was only ever scored.
"""

from .arms import ARMS, extended
from .folder import BENCH_FILE, PLOT_FILE
from .job import BenchResult, run_bench

__all__ = ["ARMS", "BENCH_FILE", "PLOT_FILE", "BenchResult", "extended", "run_bench"]
