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
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    numbers["peak_memory_bytes"] = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    Path(answer_file).write_text(json.dumps({"numbers": numbers}))


if __name__ == "__main__":
    main(*sys.argv[1:])
