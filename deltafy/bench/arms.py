"""The arms of ``deltafy bench`` as data, the LoRA ranks that match their parameter budgets, and the rates
they sweep."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import DeltafyError
from ..recipe import HEAD_MODES, RANK_MAX


@dataclass(frozen=True)
class Arm:
    recipe: str  # the bundled recipe its starting point is converted with
    train: Literal["heads", "lora", "heads+lora", "ia3", "ln-tuning", "base", "all"]
    description: str
    # The arm whose trainable-parameter count this arm's LoRA rank matches (LoRA arms only).
    lora_matches: str | None = None
    # The arm whose swept learning rate this arm's heads train at; its own sweep then moves the
    # LoRA rate alone (one joint multiplier would tie two groups whose best rates differ).
    heads_lr_from: str | None = None
    dora: bool = False  # LoRA with peft's learned magnitude per output (use_dora)


ARMS: dict[str, Arm] = {
    "heads": Arm("ddl-scalar", "heads", "the scalar DDL heads (k = the sublayer's own write)"),
    "logit": Arm("ddl-scalar-logit", "heads", "the scalar DDL heads held off by a gate logit of -18 instead"),
    "write-only": Arm("ddl-write-only", "heads", "the scalar heads without DDL's erase term -k^T x (its control)"),
    "learned": Arm("ddl-learned", "heads", "DDL heads with a learned low-rank direction"),
    "expanded": Arm("ddl-expanded", "heads", "the paper's expanded state (d_v channels)"),
    "lora": Arm("ddl-scalar", "lora", "LoRA alone at the heads' parameter count", lora_matches="heads"),
    "ddl+lora": Arm("ddl-scalar", "heads+lora", "the DDL heads plus LoRA of the lora arm's rank", "heads", "heads"),
    "lora-2x": Arm("ddl-scalar", "lora", "LoRA at ddl+lora's parameter count", lora_matches="ddl+lora"),
    "lora-large": Arm("ddl-scalar", "lora", "LoRA at the learned direction's parameter count", "learned"),
    "dora": Arm(
        "ddl-scalar", "lora", "DoRA (LoRA with a learned magnitude) at the lora arm's rank", "heads", dora=True
    ),
    "full": Arm("ddl-scalar", "base", "every weight of the original (the heads stay off): full fine-tuning"),
    "ddl+full": Arm(
        "ddl-scalar", "all", "every weight of the converted model, the heads at their own rate", None, "heads"
    ),
    "ln-tuning": Arm(
        "ddl-scalar", "ln-tuning", "LayerNorm tuning at its own count: the norms' weights (peft's targets)"
    ),
    "ia3": Arm("ddl-scalar", "ia3", "peft's (IA)^3 at its own count: learned scales on keys, values, feed-forward"),
}


def swept_group(name: str) -> str:
    """What an arm with a borrowed heads' rate sweeps beside it: its LoRA's rate, or the pretrained weights'."""
    return "LoRA" if ARMS[name].train == "heads+lora" else "weights"


def rate_label(name: str, multiplier: float, heads: float | None) -> str:
    """A run's learning-rate multipliers as the bench's progress names them."""
    return f"lr ×{multiplier:g}" if heads is None else f"heads ×{heads:g}, {swept_group(name)} ×{multiplier:g}"


def parse_arms(names: list[str] | str | None) -> list[str]:
    """The selected arms in the order given (every arm when none is named)."""
    if names is None:
        return list(ARMS)
    if isinstance(names, str):
        names = names.split(",")
    chosen = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    unknown = [n for n in chosen if n not in ARMS]
    if unknown or not chosen:
        what = f"unknown arm {', '.join(map(repr, unknown))}" if unknown else "no arm selected"
        raise DeltafyError(f"--arms: {what}; choose from {', '.join(ARMS)}")
    return chosen


def needed(arms: list[str]) -> list[str]:
    """The arms whose counts the selected ones depend on, each after what it matches."""
    order: list[str] = []

    def visit(name: str) -> None:
        for before in (ARMS[name].lora_matches, ARMS[name].heads_lr_from):
            if before is not None:
                visit(before)
        if name not in order:
            order.append(name)

    for name in arms:
        visit(name)
    return order


def recipes_for(arms: list[str]) -> list[str]:
    """Every recipe the arms train or count with: a LoRA arm matched to ``learned`` counts its heads."""
    return list(dict.fromkeys(ARMS[name].recipe for name in needed(arms)))


def swept(names: list[str]) -> list[str]:
    """The arms a bench of ``names`` sweeps: each one, and each arm whose heads' rate one borrows."""
    return list(dict.fromkeys(n for name in names for n in (ARMS[name].heads_lr_from, name) if n is not None))


def extended(grid: list[float], best: float) -> float | None:
    """The next multiplier past the end of the sorted ``grid`` where ``best`` sits, a step of the
    ratio between that end and its neighbour (3 significant digits: folder names stay readable)."""
    if len(grid) < 2 or best not in (grid[0], grid[-1]):
        return None
    end, neighbour = (grid[-1], grid[-2]) if best == grid[-1] else (grid[0], grid[1])
    return float(f"{end * end / neighbour:.3g}")


def rates_of(name: str, options) -> dict:
    """The learning rates (and LoRA rank) a run of arm ``name`` records, from its options."""
    train = ARMS[name].train
    return {
        "lr": options.lr if train in HEAD_MODES else options.lora_lr,
        "lora_lr": options.lora_lr if train != "heads" else None,  # (ia3's rate, and the base weights')
        "lora_r": options.lora_r if "lora" in train else None,
    }


def nearest_rank(target: int, per_rank: int) -> int:
    """The LoRA rank whose parameter count is nearest ``target`` (the smaller one on a tie)."""
    low = max(1, min(RANK_MAX, target // per_rank))
    high = min(RANK_MAX, low + 1)
    return low if abs(low * per_rank - target) <= abs(high * per_rank - target) else high


class Budgets:
    """Trainable-parameter counts measured on the converted models, with the code training uses
    (the heads' optimizer groups, peft's adapter), so each matched rank is what a run trains."""

    def __init__(self, models: dict[str, Path], lora_targets: list[str] | None):
        self.models = models
        self.lora_targets = lora_targets
        self._heads: dict[str, int] = {}
        self._trained: dict[tuple[str, str, bool], int] = {}
        self.targets: list[str] | None = None  # the LoRA targets peft resolved

    def heads(self, recipe: str) -> int:
        if recipe not in self._heads:
            from ..surgery import head_parameter_groups

            model = _load(self.models[recipe])
            self._heads[recipe] = sum(p.numel() for g in head_parameter_groups(model) for p in g["params"])
        return self._heads[recipe]

    def per_rank(self) -> int:
        """LoRA parameters per unit of rank on the targets (linear in the rank for every layer peft wraps)."""
        return self.trained("lora", ARMS["lora"].recipe)

    def trained(self, mode: str, recipe: str, dora: bool = False) -> int:
        """What training ``mode`` trains, counted by select_trainable: at rank 1 where the mode has a rank
        (LoRA, DoRA), else its natural count (ia3, ln-tuning, base, all), on the model ``recipe`` converts."""
        if (mode, recipe, dora) not in self._trained:
            from ..options import options_from
            from ..training.trainable import select_trainable

            model = _load(self.models[recipe])
            options = options_from(
                None, train=mode, lora_r=1, lora_alpha=1.0, lora_dora=dora, lora_targets=self.lora_targets
            )
            with warnings.catch_warnings():  # transformers' deprecations inside peft: nothing the user can act on
                warnings.simplefilter("ignore", FutureWarning)
                model, groups = select_trainable(model, mode, options)
            self._trained[mode, recipe, dora] = sum(p.numel() for g in groups for p in g["params"])
            if mode == "lora" and not dora:
                self.targets = sorted(model.peft_config["default"].target_modules)
        return self._trained[mode, recipe, dora]

    def rank(self, name: str) -> int | None:
        arm = ARMS[name]
        return None if arm.lora_matches is None else nearest_rank(self.count(arm.lora_matches), self.per_rank())

    def count(self, name: str) -> int:
        arm = ARMS[name]
        if arm.train in ("ia3", "ln-tuning", "base", "all"):  # no rank to match: what the mode trains
            return self.trained(arm.train, arm.recipe)
        heads = self.heads(arm.recipe) if arm.train in HEAD_MODES else 0
        rank = self.rank(name)
        magnitudes = self.trained("lora", arm.recipe, dora=True) - self.per_rank() if arm.dora else 0  # one per output
        return heads + (rank * self.per_rank() + magnitudes if rank else 0)


def _load(folder: Path):
    """A converted model, loaded to be counted: without transformers' loading bar, which would cut
    through the bench's own."""
    from ..checkpoint import load
    from ..quiet import quiet_transformers

    with quiet_transformers():
        return load(folder, dtype="float32")
