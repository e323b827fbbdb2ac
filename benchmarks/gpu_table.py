"""The device run's table (benchmarks/gpu.py): its measures with their units and targets, a row per model
and measure filled in as cells finish, rendered as text (ratios, targets met) and as JSON."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

LABELS = {
    "smollm2": "SmolLM2-135M",
    "llama-1b": "Llama-1B (random)",
    "tiny-llama": "tiny Llama (random)",
    "deep-tiny-llama": "tiny Llama, 30 layers",
}

# measure -> (unit, baseline column label, target: (">=" or "<=", value) or None)
MEASURES = {
    "prefill": ("tok/s", "original", (">=", 0.97)),
    "prefill compiled": ("tok/s", "original", (">=", 0.97)),
    "decode b1": ("tok/s", "original", (">=", 0.90)),
    "decode b1 compiled": ("tok/s", "original", (">=", 0.95)),
    "decode b8": ("tok/s", "original", None),
    "decode b8 compiled": ("tok/s", "original", None),
    "train step vs full": ("ms", "full FT", ("<=", 0.60)),
    "train step vs LoRA": ("ms", "LoRA r=8", ("<=", 1.10)),
    "train step floor vs full": ("ms", "full FT", None),  # (reference column: the frozen original, no sites)
    "train memory vs full": ("GiB", "full FT", None),
    "train memory vs LoRA": ("GiB", "LoRA r=8", ("<=", 1.10)),
    "train step compiled vs full": ("ms", "full FT", ("<=", 0.60)),
    "train step compiled vs LoRA": ("ms", "LoRA r=8", ("<=", 1.10)),
    "train memory compiled vs LoRA": ("GiB", "LoRA r=8", ("<=", 1.10)),
    "max |dlogits|": ("abs", "max|logits|", None),
    "kernels decode b1": ("count", "original", None),  # (two targets: reference <= 1.8x, fused <= 1.15x)
}
COLUMNS = {"baseline": "original", "reference": "reference", "fused": "fused"}  # column -> variant
TRAIN_MEASURES = (
    "train step vs full",
    "train step vs LoRA",
    "train step floor vs full",
    "train memory vs full",
    "train memory vs LoRA",
)
TRAIN_COMPILED = ("train step compiled vs full", "train step compiled vs LoRA", "train memory compiled vs LoRA")


@dataclass
class Row:
    model: str
    measure: str
    cells: dict = field(default_factory=dict)  # "baseline", "reference", "fused" -> float or a note

    def ratio(self, column: str):
        base, value = self.cells.get("baseline"), self.cells.get(column)
        if isinstance(base, float) and isinstance(value, float) and base > 0:
            return value / base
        return None


class Table:
    """The rows in display order, filled in as cells finish (in whatever order they run)."""

    def __init__(self):
        self.rows: dict[tuple[str, str], Row] = {}
        self.notes: list[str] = []
        self.lock = threading.Lock()

    def declare(self, model: str) -> None:
        for measure in MEASURES:
            self.rows[model, measure] = Row(model, measure)

    def set(self, model: str, measure: str, column: str, value) -> None:
        with self.lock:
            self.rows[model, measure].cells[column] = value

    def note(self, text: str) -> str:
        """A footnote's mark for a cell that holds no number."""
        with self.lock:
            if text not in self.notes:
                self.notes.append(text)
            return f"[{self.notes.index(text) + 1}]"

    def cell(self, value, width: int) -> str:
        if isinstance(value, float):
            if abs(value) >= 100:
                text = f"{value:.1f}"
            elif abs(value) >= 0.01 or value == 0:
                text = f"{value:.3f}"
            else:
                text = f"{value:.2e}"
        elif value is None:
            text = "n/a" + self.note("not reached")
        else:
            text = ("error" if str(value).startswith("error") else "n/a") + self.note(str(value))
        return f"{text:>{width}s}"

    def render(self) -> str:
        head = (
            f"{'model':22s} {'measure':29s} {'unit':5s} {'vs':>11s} {'baseline':>10s} {'reference':>10s}"
            f" {'ratio':>6s} {'fused':>10s} {'ratio':>6s} {'target':>7s} {'met':>17s}"
        )
        lines = [head, "-" * len(head)]
        for row in list(self.rows.values()):
            unit, base_label, target = MEASURES[row.measure]
            ratios = {c: row.ratio(c) for c in ("reference", "fused")}
            if row.measure == "max |dlogits|":
                ref_cell = f"{'-':>10s}"
            else:
                ref_cell = self.cell(row.cells.get("reference"), 10)
            met = []
            if target:
                op, bound = target
                for column, short in (("reference", "ref"), ("fused", "fused")):
                    r = ratios[column]
                    if r is not None:
                        ok = r >= bound if op == ">=" else r <= bound
                        met.append(f"{short} {'yes' if ok else 'NO'}")
            lines.append(
                f"{LABELS.get(row.model, row.model):22s} {row.measure:29s} {unit:5s} {base_label:>11s}"
                f" {self.cell(row.cells.get('baseline'), 10)} {ref_cell} {_ratio(ratios['reference'])}"
                f" {self.cell(row.cells.get('fused'), 10)} {_ratio(ratios['fused'])}"
                f" {(target[0] + str(target[1])) if target else '-':>7s} {', '.join(met) or '-':>17s}"
            )
        lines += [f"  [{i}] {text}" for i, text in enumerate(self.notes, 1)]
        return "\n".join(lines)

    def to_json(self) -> list[dict]:
        out = []
        for row in self.rows.values():
            cells = {k: v for k, v in row.cells.items()}
            out.append(
                dict(
                    model=row.model,
                    measure=row.measure,
                    unit=MEASURES[row.measure][0],
                    baseline_label=MEASURES[row.measure][1],
                    **{c: cells.get(c) for c in ("baseline", "reference", "fused")},
                    reference_ratio=row.ratio("reference"),
                    fused_ratio=row.ratio("fused"),
                    target=MEASURES[row.measure][2],
                )
            )
        return out


def _ratio(r) -> str:
    text = "-" if r is None else f"{r:.3f}" if r == 0 or abs(r) >= 0.001 else f"{r:.0e}"
    return f"{text:>6s}"


def finite_json(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value
