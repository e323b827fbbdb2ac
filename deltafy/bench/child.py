"""One bench training run in a process of its own (``python -m deltafy.bench.child JOB ANSWER``),
which reports its numbers and its own peak RSS in the ANSWER file."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

from ..errors import DeltafyError
from .runs import ERROR_KINDS, train


def main(job_file: str, answer_file: str) -> None:
    from transformers.utils import logging as hf_logging

    from ..options import TrainOptions

    hf_logging.disable_progress_bar()  # as the deltafy command does in its own process
    job = json.loads(Path(job_file).read_text())
    try:
        numbers = train(
            job["model_dir"], job["data"], job["out"], TrainOptions.model_validate(job["options"]), job["eval_data"]
        )
    except DeltafyError as err:
        kind = type(err).__name__ if type(err).__name__ in ERROR_KINDS else "DeltafyError"
        Path(answer_file).write_text(json.dumps({"error": str(err), "kind": kind}))
        sys.exit(1)
    numbers["peak_memory_bytes"] = peak_rss_bytes()
    Path(answer_file).write_text(json.dumps({"numbers": numbers}))


def peak_rss_bytes() -> int:
    """This process's peak resident memory. On Linux, its program's own (/proc's VmHWM): getrusage's
    ru_maxrss starts from the peak of the process that launched this one (fork and exec carry it over),
    so a run started by a bench that had converted a model would report at least the bench's peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:  # no /proc (macOS)
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


if __name__ == "__main__":
    main(*sys.argv[1:])
