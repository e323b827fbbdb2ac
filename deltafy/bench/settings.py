"""The settings of a bench, checked before any work: each bad value named as its flag, and text too
short to train, validate or report on refused before the first run."""

from __future__ import annotations

from pathlib import Path

from ..errors import DeltafyError


def default_eval_every(steps: int) -> int:
    return max(1, steps // 5)  # five points of each curve besides the start


def check(data, eval_data, resume: bool, overwrite: bool) -> None:
    from ..training.run_folder import check_resume

    check_resume(resume, overwrite)
    if not data:
        raise DeltafyError("bench needs --data: the text every arm trains on")
    if not eval_data:
        raise DeltafyError("bench needs --eval-data: the held-out text every arm is reported on")


def options_for(recipes, options) -> None:
    """The values every run takes, checked as a run's before any work (each bad one named as its flag)."""
    from ..options import options_from
    from ..recipe import load_recipe

    base = load_recipe(recipes[0]).training.model_dump()
    options_from(
        base,
        steps=options.steps,
        seq_len=options.seq_len,
        batch_size=options.batch_size,
        eval_every=options.eval_every,
        max_eval_blocks=options.max_eval_blocks,
        lora_targets=options.lora_targets,
        text_field=options.text_field,
    )
    for recipe in recipes[1:]:
        load_recipe(recipe)


def data_fingerprints(model_dir: Path, data, eval_data, seq_len: int, text_field: str, status) -> dict:
    """Read both texts once (the runs then find them in the token cache) and refuse text too short
    to train, validate or report on before any run starts."""
    from ..checkpoint import load_tokenizer
    from ..data import fingerprint, pack, split_held_out, token_stream
    from ..recipe import TrainingDefaults

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
