"""Figures a checkpoint's card shows: the mean gate factor (β, or α·β) per layer and site, and a run's losses.

matplotlib is imported only when a figure is drawn, and only its object-oriented API is used (no
pyplot): no GUI backend is touched and no global figure state is left behind in a library call.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections.abc import Mapping
from pathlib import Path

from ..errors import DeltafyError
from ..files import BETA_FIGURE, LOSS_FIGURE, METRICS_FILE, read_metrics, run_summary

log = logging.getLogger(__name__)

FIGURE_SIZE = (8.0, 4.5)  # inches; at DPI a 960×540 image, readable on a model page
DPI = 120
FORMATS = (".png", ".svg", ".pdf")


def betas_by_site(betas: Mapping) -> dict[str, list[float]]:
    """Per-site lists of mean β indexed by layer, from ``mean_betas``' qualified names
    (``model.layers.3.delta.attn``) or already as ``{site: [β per layer]}``."""
    if all(isinstance(v, list | tuple) for v in betas.values()):
        return {str(site): [float(x) for x in values] for site, values in betas.items()}
    by_site: dict[str, dict[int, float]] = {}
    for name, value in betas.items():
        prefix, _, site = str(name).rpartition(".delta.")
        try:
            layer = int(prefix.rsplit(".", 1)[-1])
        except ValueError:
            raise DeltafyError(f"cannot tell the layer of the DDL site {name!r}") from None
        by_site.setdefault(site, {})[layer] = float(value)
    layers = max((max(v) for v in by_site.values()), default=-1) + 1
    return {site: [v.get(i, math.nan) for i in range(layers)] for site, v in by_site.items()}


def _figure():
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise DeltafyError("drawing figures needs matplotlib: pip install matplotlib") from err
    return Figure(figsize=FIGURE_SIZE, dpi=DPI, layout="constrained")


def check_format(path: Path) -> None:
    if path.suffix.lower() not in FORMATS:
        raise DeltafyError(f"{path}: a figure is saved as {', '.join(FORMATS)}; name the file with one of them")


def _save(fig, path: Path) -> Path:
    """Write the figure beside its final name, then rename: an interrupted save leaves no half image."""
    path = Path(path)
    check_format(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    try:
        fig.savefig(tmp, dpi=DPI)
        os.replace(tmp, path)
    except OSError as err:
        raise DeltafyError(f"could not write {path}: {err.strerror or err}") from err
    finally:
        tmp.unlink(missing_ok=True)
    return path


def factor_label(spec: Mapping) -> str:
    """What a site's mean multiplies its correction by: α·β with a strength gate (α starts at 0 and
    may turn negative), β = 2σ(gate) in (0, 2) with a logit gate."""
    return "α·β" if spec.get("gate") == "strength" else "β"


def plot_betas(betas: Mapping, path: str | Path, title: str = "", label: str = "β", measured_on: str = "") -> Path:
    """Draw ``beta_figure`` into ``path``."""
    return _save(beta_figure(betas, title, label, measured_on), Path(path))


def beta_figure(betas: Mapping, title: str = "", label: str = "β", measured_on: str = ""):
    """Mean ``label`` (β, or α·β) per layer, one line per site, every value drawn with its sign, over the
    tokens of ``measured_on`` (a β is a per-token factor: its mean depends on the text), named under the title.

    The axis is linear, so that sign and size read directly, unless it would flatten most sites onto the
    zero line (half of them under a twentieth of the largest: a logit gate's 3e-8 beside an opened 0.5);
    then it is symmetric-log, linear within a power of ten at or below the smallest magnitude and
    logarithmic beyond, and a negative α·β (a site that learned to remove its correction) still lies
    below the zero line instead of vanishing."""
    by_site = betas_by_site(betas)
    if not by_site:
        raise DeltafyError("the model has no DDL sites to draw")
    fig = _figure()
    ax = fig.add_subplot()
    magnitudes = [abs(x) for values in by_site.values() for x in values if math.isfinite(x) and x != 0]
    for site, values in by_site.items():
        ax.plot(range(len(values)), values, marker="o", markersize=4, linewidth=1.5, label=site)
    ax.axhline(0.0, color="0.5", linewidth=0.8)
    scale = ""
    if magnitudes and statistics.median(magnitudes) < max(magnitudes) / 20:
        linthresh = 10.0 ** math.floor(math.log10(min(magnitudes)))  # a round number: its ticks read as such
        ax.set_yscale("symlog", linthresh=linthresh, linscale=1.0)
        scale = f" (symmetric log scale, linear within ±{linthresh:g})"
    ax.margins(y=0.06)  # the largest markers whole, not cut by the frame
    layers = max(len(v) for v in by_site.values())
    ax.set_xticks(range(0, layers, max(1, math.ceil(layers / 16))))
    ax.set_xlabel("layer")
    ax.set_ylabel(f"mean {label}{scale}")
    heading = f"Mean {label} per layer and site" + (f" · {title}" if title else "")
    ax.set_title(heading + (f"\non {measured_on}" if measured_on else ""))
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(title="site")
    return fig


def plot_training(metrics_file: str | Path, path: str | Path, title: str = "") -> Path:
    """Training loss per logged step and held-out loss at each evaluation (from a run's metrics.jsonl),
    with the held-out loss before training at step 0 and after it at the last step."""
    records = read_metrics(metrics_file)
    train = [(r["step"], r["loss"]) for r in records if r.get("event") != "summary" and "loss" in r and "step" in r]
    held = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r and "step" in r]
    summary = run_summary(records)
    last = max([s for s, _ in train + held] + [summary.get("steps") or 0])
    if isinstance(summary.get("loss_before"), int | float):
        held.insert(0, (0, summary["loss_before"]))
    if isinstance(summary.get("loss_after"), int | float):
        held = [(s, x) for s, x in held if s != last] + [(last, summary["loss_after"])]  # the final word at the end
    if not train and not held:
        raise DeltafyError(f"{metrics_file} holds no losses to draw")
    fig = _figure()
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train, strict=True), linewidth=1.2, alpha=0.85, label="training loss")
    if held:
        ax.plot(*zip(*sorted(held), strict=True), marker="o", linewidth=1.8, label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(f"Loss · {title}" if title else "Loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, Path(path))


def write_training_figures(
    out: str | Path, betas: Mapping | None = None, label: str = "β", measured_on: str = ""
) -> list[str]:
    """Draw a finished run's figures into its folder ``out``: ``loss.png`` from its metrics.jsonl and
    ``beta.png`` from ``betas`` (``mean_betas``' per-site numbers, measured on ``measured_on``) or else
    the summary's mean β per layer. Returns the file names written, for the card. A figure that cannot
    be drawn is skipped with a warning: it must never cost a trained model."""
    out = Path(out)
    title = out.resolve().name
    written = []
    try:
        records = read_metrics(out / METRICS_FILE)
    except DeltafyError as err:
        log.warning("no loss figure: %s", err)
        records = []
    if records:
        try:
            plot_training(out / METRICS_FILE, out / LOSS_FIGURE, title)
            written.append(LOSS_FIGURE)
        except DeltafyError as err:
            log.warning("no loss figure: %s", err)
    if betas is None:
        summary = run_summary(records)
        per_layer, measured_on = summary.get("mean_beta_per_layer"), summary.get("mean_beta_on", "")
        betas = {"all sites": per_layer} if per_layer else None
    if betas:
        try:
            plot_betas(betas, out / BETA_FIGURE, title, label, measured_on)
            written.append(BETA_FIGURE)
        except DeltafyError as err:
            log.warning("no β figure: %s", err)
    return written


def plot_bench(curves: Mapping[str, list], path: str | Path, title: str = "") -> Path:
    """Held-out loss against step, one line per arm of ``deltafy bench`` (``{arm: [(step, loss), ...]}``,
    the mean over its seeds), all on the same held-out text and so on one axis."""
    drawn = {arm: points for arm, points in curves.items() if points}
    if not drawn:
        raise DeltafyError("the bench has no held-out losses to draw")
    fig = _figure()
    ax = fig.add_subplot()
    for arm, points in drawn.items():
        ax.plot(*zip(*sorted(points), strict=True), marker="o", markersize=3, linewidth=1.6, label=arm)
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats per token)")
    ax.set_title(f"Held-out loss · {title}" if title else "Held-out loss")
    ax.grid(True, alpha=0.3)
    ax.legend(title="arm")
    return _save(fig, Path(path))
