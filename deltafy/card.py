"""The checkpoint's README.md: a Hugging Face model card (front matter through huggingface_hub's
``ModelCardData``, so the Hub reads base model, relation, license and eval results as it expects).

Everything in it is public once pushed: local paths are reduced to their last part, and strings
that look like access tokens are left out.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath, PureWindowsPath

from .files import BETA_FIGURE, LOSS_FIGURE
from .sources.load import ALIAS_BASE_MODELS

_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{16,}\b")
_WINDOWS_ABSOLUTE = re.compile(r"^[A-Za-z]:[\\/]")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")

# Captions for the figures deltafy writes; another file is shown under its own name.
FIGURE_CAPTIONS = {
    LOSS_FIGURE: "Training loss per step and held-out loss",
    BETA_FIGURE: "Mean gate factor per layer and site (α·β with a strength gate, β with a logit gate)",
}


def is_local_path(text: str) -> bool:
    """Whether ``text`` names a place on some machine (absolute, home- or dot-relative) rather than a Hub id."""
    return text.startswith(("/", "~", "./", "../", "\\")) or bool(_WINDOWS_ABSOLUTE.match(text)) or text in (".", "..")


def public_name(text: str) -> str:
    """A data or model source as the card may show it: a local path by its last part, a Hub id as it is."""
    if not is_local_path(text) and "\\" not in text:
        return text.rstrip("/")
    # The last part of a path: a card can show a folder's name, never where it sits on one machine.
    name = PureWindowsPath(text).name if "\\" in text or _WINDOWS_ABSOLUTE.match(text) else PurePosixPath(text).name
    return name or text.strip("/\\.~") or "model"


def public(value):
    """``value`` with every local path reduced to its name and every token-like string removed."""
    if isinstance(value, dict):
        return {k: public(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [public(v) for v in value]
    if isinstance(value, str):
        value = _TOKEN.sub("[token removed]", value)
        return public_name(value) if is_local_path(value) else value
    return value


def base_model(spec: dict, provenance: dict) -> str | None:
    """The Hub model this one was made from, when there is one to link to."""
    base = spec.get("base") or {}
    for key in ("id", "repo_id", "model"):
        candidate = base.get(key)
        if isinstance(candidate, str) and _HUB_ID.match(candidate) and not is_local_path(candidate):
            return candidate
    if provenance.get("kind") == "hub":
        return provenance.get("source")
    # A bundled alias: the model its file was made from.
    return provenance.get("base_model") or ALIAS_BASE_MODELS.get(base.get("alias") or provenance.get("alias"))


def _title(spec: dict, provenance: dict) -> str:
    source = provenance.get("alias") or provenance.get("source") or base_model(spec, provenance) or "model"
    return f"{public_name(str(source)).split('/')[-1]} + Deep Delta Learning"


def _eval_results(training: dict, model_name: str) -> list:
    from huggingface_hub import EvalResult

    before, after = training.get("loss_before"), training.get("loss_after")
    if not all(isinstance(x, int | float) and math.isfinite(x) for x in (before, after)):
        return []
    names = [public_name(s) for s in training.get("eval_data") or training.get("data") or []]
    dataset = ", ".join(names) or "held-out text"
    split = "validation" if training.get("eval_data") else "held-out"
    return [
        EvalResult(
            task_type="text-generation",
            dataset_type=dataset,
            dataset_name=dataset,
            dataset_split=split,
            metric_type="loss",
            metric_name=f"held-out loss {when} training",
            metric_value=round(float(value), 4),
        )
        for when, value in (("before", before), ("after", after))
    ]


def _front_matter(spec: dict, provenance: dict, training: dict | None, model_name: str):
    from huggingface_hub import ModelCardData

    base = base_model(spec, provenance)
    license_ = provenance.get("license") or (spec.get("base") or {}).get("license")
    data = ModelCardData(
        model_name=model_name,
        base_model=base,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license_ if isinstance(license_, str) else None,
        tags=["deltafy", "deep-delta-learning", spec["base_model_type"]],
        eval_results=_eval_results(training, model_name) if training else None,
    )
    data.base_model_relation = "adapter" if spec.get("base") else "finetune"
    return data


def _loading(config: dict, spec: dict, provenance: dict, repo_id: str | None, adapter: str | None) -> list[str]:
    where = repo_id or "OWNER/NAME"
    note = "" if repo_id else "  # this repository's id, or the path of the folder"
    # a LoRA kept apart is part of the model trained: without it the heads alone load, not what was measured
    kept = f'model.load_adapter(repo, adapter_kwargs={{"subfolder": "{adapter}"}})  # its LoRA; needs peft'
    needs = "`torch`, `transformers` and (for its LoRA adapter) `peft`" if adapter else "`torch` and `transformers`"
    lines = [
        "## How to load it",
        "",
        f"It needs only {needs}: the folder carries its own modeling file (plain PyTorch), "
        "which `trust_remote_code=True` lets transformers run.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'repo = "{where}"{note}',
        "model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)",
        *[kept] * bool(adapter),
        "tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)",
        "```",
        "",
    ]
    if adapter:
        lines += [
            f"The LoRA adapter trained with the heads is kept apart in `{adapter}/`, the base weights untouched: "
            "without it the model is the heads alone, not the model the held-out loss below was measured on.",
            "",
        ]
    if "AutoModel" in config.get("auto_map", {}):
        lines += ["`AutoModel` gives the bare DDL model (hidden states, no language-model head) the same way.", ""]
    base = spec.get("base")
    if base:
        pinned = base_model(spec, provenance) or public_name(str(base.get("path") or base.get("id") or "base"))
        revision = f" at revision `{base['revision']}`" if base.get("revision") else ""
        lines += [
            f"This folder holds only the new tensors: loading it first loads the base model `{pinned}`{revision}, "
            "checks it is the one the heads were made for, then applies the heads.",
            "",
        ]
    return lines


def _conversion(spec: dict) -> list[str]:
    recipe = spec["recipe"]
    beta = 2 / (1 + math.exp(-spec["gate_bias"]))
    return [
        "## Conversion",
        "",
        f"- recipe: `{recipe['name']}` (direction `{spec['direction']}`"
        + (f", rank {spec['rank']}" if spec.get("rank") else "")
        + ")",
        f"- layout: {spec['layout']}; sites per layer: {', '.join(s['name'] for s in spec['sites'])}",
        f"- initial gate logit {spec['gate_bias']} (β = {beta:.2e})"
        + ("; a per-site strength α, zero at init, scales the correction" if spec.get("gate") == "strength" else ""),
        *_expanded(spec),
        "",
    ]


def _expanded(spec: dict) -> list[str]:
    d_v = spec.get("channels", 1)
    if d_v == 1:
        return []
    return [
        f"- expanded state: the residual stream carries {d_v} channels ({d_v} × {spec['hidden_size']} values per "
        f"token); each sublayer reads a view of them through its own read weights, and the final norm reads the "
        f"last layer's view (attention and its KV cache are unchanged)"
    ]


def _equivalence(check: dict) -> list[str]:
    if check["greedy_identical"] is None:  # a layer-by-layer check: it would read the model once per token
        greedy = "| greedy generation with KV cache | not run (checked a decoder layer at a time) |"
    else:
        same = "identical" if check["greedy_identical"] else "DIFFERENT"
        greedy = f"| greedy generation, {check['greedy_tokens']} tokens with KV cache | {same} |"
    return [
        f"## Init equivalence (measured at conversion, {check.get('dtype', 'float32')})",
        "",
        "| check | result |",
        "|---|---|",
        f"| max abs Δlogits vs original, default init | {check['max_abs_dlogits']:.2e} "
        f"(tolerance {check['tolerance']:.2g}) |",
        f"| logits with β = 0 bitwise identical | {'yes' if check['beta_zero_bitwise'] else 'NO'} |",
        greedy,
        "",
    ]


def _training(training: dict, figures: Iterable[str]) -> list[str]:
    rows = [("what trained", f"`{training.get('mode', 'heads')}`")]
    if training.get("steps") is not None:
        rows.append(("steps", f"{training['steps']:,}"))
    if training.get("tokens") is not None:
        rows.append(("tokens", f"{training['tokens']:,}"))
    if training.get("trainable_params") is not None:
        rows.append(("trainable parameters", f"{training['trainable_params']:,}"))
    if training.get("data"):
        rows.append(("data", ", ".join(f"`{public_name(s)}`" for s in training["data"])))
    if training.get("eval_data"):
        rows.append(("held-out data", ", ".join(f"`{public_name(s)}`" for s in training["eval_data"])))
    before, after = training.get("loss_before"), training.get("loss_after")
    if isinstance(before, int | float) and isinstance(after, int | float):
        rows.append(("held-out loss", f"{before:.4f} → {after:.4f} ({after - before:+.4f})"))
    return ["## Training", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), "", *_figures(figures)]


def _figures(figures: Iterable[str]) -> list[str]:
    return [line for f in figures for line in (f"![{FIGURE_CAPTIONS.get(f, Path(f).stem)}]({f})", "")]


def model_card(
    config: dict,
    spec: dict,
    provenance: dict,
    check: dict | None,
    training: dict | None = None,
    figures: Iterable[str] = (),
    repo_id: str | None = None,
) -> str:
    """The README.md of a checkpoint folder.

    ``training`` (after ``deltafy train``): ``mode``, ``steps``, ``tokens``, ``trainable_params``,
    ``data`` and ``eval_data`` (the sources as given; only their names are shown), ``loss_before``
    and ``loss_after`` (held-out). ``figures``: PNG file names in the folder, embedded in the card.
    ``repo_id``: the Hub repository it goes to, for the loading example.
    """
    from huggingface_hub import ModelCard

    provenance = public(provenance)
    spec = public(spec)
    figures = [public_name(f) for f in figures]
    title = _title(spec, provenance)
    data = _front_matter(spec, provenance, public(training) if training else None, title)
    lines = [
        f"# {title}",
        "",
        f"A `{spec['base_model_type']}` model converted by deltafy: "
        "every residual write `x + h` became a Deep Delta Learning write "
        "`x + h + β(v − kᵀx)k` (Zhang et al., *Deep Delta Learning*, arXiv 2601.00417).",
        "",
        *_loading(config, spec, provenance, repo_id, (training or {}).get("adapter")),
        *_conversion(spec),
        *(_equivalence(check) if check else []),
        *(_training(public(training), figures) if training else []),
        *(_figures(figures) if figures and not training else []),
        "## Provenance",
        "",
        "```json",
        json.dumps(provenance, indent=2),
        "```",
        "",
    ]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))
    return str(card)
