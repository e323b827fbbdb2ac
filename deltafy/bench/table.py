"""The bench's table: one row per arm, the means over its seeds' records, and what marks a row."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A seed whose held-out loss rises more than this share above its start is marked: a rate at the edge of
# divergence (the KJV's heads at ×10 jumped 22%), not the noise of a held-out loss that barely moves.
ROSE = 0.01


@dataclass
class Row:
    """One arm in the table: means over its seeds."""

    arm: str
    trainable_params: int
    seeds: int
    loss_before: float
    loss_after: float
    delta: float
    delta_se: float | None  # None for one seed
    lr_multiplier: float  # of the LoRA rate where the heads' rate comes from another arm's sweep
    lr: float
    lora_r: int | None
    seconds_per_step: float
    peak_memory_bytes: int | None
    lr_at_edge: bool  # the best rate is at an end of the sweep, even after extending it: it may be too narrow
    heads_lr_multiplier: float | None = None  # where the heads train at another arm's best rate
    lora_lr: float | None = None
    # (seed, first such step) for each seed whose held-out loss rose over ROSE above its loss before training.
    rose_above_start: list[tuple[int, int]] = field(default_factory=list)


def row_of(name: str, records: list[dict], at_edge: bool) -> Row:
    """Arm ``name``'s row from its seeds' records; ``at_edge``: its sweep's best is at an end of the grid."""

    def mean(key: str) -> float:
        return sum(r[key] for r in records) / len(records)

    k = len(records)
    deltas = [r["delta"] for r in records]
    se = None
    if k > 1:
        m = sum(deltas) / k
        se = math.sqrt(sum((d - m) ** 2 for d in deltas) / (k - 1)) / math.sqrt(k)
    peaks = [r["peak_memory_bytes"] for r in records if r["peak_memory_bytes"] is not None]
    first = records[0]
    multiplier = first["lr_multiplier"]
    return Row(
        arm=name,
        trainable_params=first["trainable_params"],
        seeds=k,
        loss_before=mean("loss_before"),
        loss_after=mean("loss_after"),
        delta=mean("delta"),
        delta_se=se,
        lr_multiplier=multiplier,
        lr=first["lr"],
        lora_r=first["lora_r"],
        seconds_per_step=mean("seconds_per_step"),
        peak_memory_bytes=max(peaks) if peaks else None,
        lr_at_edge=at_edge,
        heads_lr_multiplier=first.get("heads_lr_multiplier"),
        lora_lr=first["lora_lr"],
        rose_above_start=[(r["seed"], step) for r in records if (step := _rose(r)) is not None],
    )


def _rose(record: dict) -> int | None:
    """The first step at which a run's held-out loss was over ROSE above its loss before training, if any."""
    limit = record["loss_before"] * (1 + ROSE)
    return next((step for step, loss in record["curve"] if step > 0 and loss > limit), None)


# The questions the bench answers, each a pair (DDL's arm, what it is judged against): the scalar heads
# against the tiny-parameter methods that also scale activations and against their own write-only
# control; DDL + LoRA against LoRA at a matched count and DoRA; the learned direction against LoRA at
# its count; the converted model trained in full against the original trained in full.
COMPARISONS = (
    ("heads", "ia3", "scalar heads vs (IA)^3, each at its own count"),
    ("heads", "ln-tuning", "scalar heads vs LayerNorm tuning, each at its own count"),
    ("heads", "write-only", "the erase term: heads vs their write-only control, same count"),
    ("ddl+lora", "lora-2x", "DDL + LoRA vs LoRA at a matched count"),
    ("ddl+lora", "dora", "DDL + LoRA vs DoRA at LoRA's rank"),
    ("learned", "lora-large", "learned direction vs LoRA at a matched count"),
    ("ddl+full", "full", "everything trained: the converted model vs the original"),
)


@dataclass
class Comparison:
    """The paired difference in held-out loss after training, ``arm`` minus ``against``, over the seeds both
    ran (a seed's two runs saw the same data in the same order): negative means ``arm`` did better."""

    arm: str
    against: str
    question: str
    seeds: int
    difference: float
    se: float | None  # None for one seed
    beyond_2se: bool  # |difference| > 2 s.e.: more than the seeds' spread explains


def comparisons(records: list[dict]) -> list[Comparison]:
    """Every comparison of COMPARISONS whose two arms both ran, paired by seed."""
    after = {(r["arm"], r["seed"]): r["loss_after"] for r in records}
    found = []
    for arm, against, question in COMPARISONS:
        seeds = sorted(s for a, s in after if a == arm and (against, s) in after)
        if not seeds:
            continue
        diffs = [after[arm, s] - after[against, s] for s in seeds]
        k, mean = len(diffs), sum(diffs) / len(diffs)
        se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (k - 1)) / math.sqrt(k) if k > 1 else None
        found.append(Comparison(arm, against, question, k, mean, se, se is not None and abs(mean) > 2 * se))
    return found
