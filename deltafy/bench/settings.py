"""The settings of a bench, checked before any work: each bad value named as its flag, and text too
short to train, validate or report on refused before the first run."""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import DeltafyError


def default_eval_every(steps: int) -> int:
    return max(1, steps // 5)  # five points of each curve besides the start


def check(steps, seeds, lrs, extend, data, eval_data, resume, overwrite) -> list[float]:
    if resume and overwrite:
        raise DeltafyError("--resume and --overwrite contradict each other; pass one of them")
    if not isinstance(steps, int) or steps < 1:
        raise DeltafyError(f"--steps takes an integer ≥ 1; got {steps}")
    if not isinstance(seeds, int) or seeds < 1:
        raise DeltafyError(f"--seeds takes an integer ≥ 1 (the seeds 0 … K-1 each arm trains); got {seeds}")
    lrs = [float(x) for x in lrs]
    if not lrs or any(not math.isfinite(x) or x <= 0 for x in lrs) or len(set(lrs)) != len(lrs):
        raise DeltafyError(
            f"--lrs takes distinct positive multipliers of each arm's default learning rate, e.g. 0.3,1,3; got "
            f"{','.join(f'{x:g}' for x in lrs) or 'none'}"
        )
    if not isinstance(extend, int) or extend < 0:
        raise DeltafyError(f"--lr-extend takes an integer ≥ 0 (0: sweep exactly --lrs); got {extend}")
    if not data:
        raise DeltafyError("bench needs --data: the text every arm trains on")
    if not eval_data:
        raise DeltafyError("bench needs --eval-data: the held-out text every arm is reported on")
    return sorted(lrs)


def options_for(recipes, names, steps, seq_len, batch_size, eval_every, max_eval_blocks, lora_targets, text_field):
    """Every value the runs take, checked before any work (each bad one named as its flag)."""
    from ..options import load_recipe, options_from

    base = load_recipe(recipes[0]).training.model_dump()
    options_from(
        base,
        steps=steps,
        seq_len=seq_len,
        batch_size=batch_size,
        eval_every=eval_every,
        max_eval_blocks=max_eval_blocks,
        lora_targets=lora_targets,
        text_field=text_field,
    )
    for recipe in recipes[1:]:
        load_recipe(recipe)


def data_fingerprints(model_dir: Path, data, eval_data, seq_len: int, text_field: str, status) -> dict:
    """Read both texts once (the runs then find them in the token cache) and refuse text too short
    to train, validate or report on before any run starts."""
    from ..checkpoint import load_tokenizer
    from ..data import fingerprint, pack, split_held_out, token_stream
    from ..options import TrainingDefaults

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise DeltafyError(f"{model_dir} has no tokenizer; a bench needs one to read text")
    status("reading the text")
    split_held_out(pack(token_stream(data, tokenizer, text_field), seq_len), TrainingDefaults().held_out, 0)
    pack(token_stream(eval_data, tokenizer, text_field), seq_len)
    return {
        "data_fingerprint": fingerprint(data, tokenizer, text_field),
        "eval_data_fingerprint": fingerprint(eval_data, tokenizer, text_field),
    }
