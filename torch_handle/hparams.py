"""Which model options a checkpoint decides and which the user decides when a run starts from one.

LightningCLI replaces every parsed ``model`` option with the checkpoint's hyper-parameters, so decoding and
backend options typed for ``test``/``predict`` were silently dropped. Here the checkpoint decides what its
weights depend on (the architecture, the task, the training recipe), and the user's explicit options decide
how the weights are run (:data:`RUNTIME`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from torch_handle.checkpoints import CheckpointError
from torch_handle.model.logits import DecodingControls

RUNTIME = frozenset(
    {
        "num_beams",
        "length_penalty",
        "max_new_tokens",
        "generate_every_n_val_epochs",
        "lead_words",
        "naive_ratio",
        "chunk_overlap",
        "long_documents",
        "transformer.attention_backend",
        "transformer.activation_checkpointing",
        *(field.name for field in dataclasses.fields(DecodingControls)),
    }
)
"""``model`` options that change how the checkpoint's weights are run, not the weights: the user's win."""

LINKED = frozenset({"vocab_size"})
"""Set from the data module's tokenizer, never typed."""

SUPERSEDED = frozenset({"init_from"})
"""Where training started: a checkpoint's weights supersede it, so a run's own command with ``--ckpt_path`` resumes
it (the checkpoint keeps None, and its weights)."""


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"transformer": {"d_model": 32}}`` -> ``{"transformer.d_model": 32}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def explicit_model_options(args: Iterable[str]) -> tuple[set[str], set[str]]:
    """The ``model`` options a user set: those typed on the command line, and those in ``--config`` files.

    Both are read from ``args`` as written (the parsed config cannot tell a default from a typed value).
    """
    typed: set[str] = set()
    configs: list[str] = []
    args = list(args)
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name.startswith("--model."):
            typed.add(name.removeprefix("--model."))
        elif name in ("--config", "-c"):
            configs.append(value if value or i + 1 >= len(args) else args[i + 1])
    in_configs: set[str] = set()
    for config in configs:
        loaded = yaml.safe_load(Path(config).read_text(encoding="utf-8") if Path(config).is_file() else config)
        if isinstance(loaded, Mapping) and isinstance(loaded.get("model"), Mapping):
            in_configs |= set(flatten(loaded["model"]))
    return typed, in_configs


def merge_checkpoint_options(
    checkpoint: Mapping[str, Any], parsed: Mapping[str, Any], typed: set[str], in_configs: set[str], source: str
) -> tuple[dict[str, Any], list[str]]:
    """The model options to run with: the checkpoint's, except the runtime options the user set.

    Args:
        checkpoint: The checkpoint's ``hyper_parameters``.
        parsed: The parsed ``model`` options (the user's and the defaults).
        typed: Options typed on the command line: one that contradicts the checkpoint is an error.
        in_configs: Options set in ``--config`` files: one that contradicts the checkpoint is replaced
            (with a note), so a shared config evaluates any checkpoint.
        source: The checkpoint's path, for messages.

    Returns:
        The nested options, and one note per config option the checkpoint replaced.
    """
    saved, current = flatten(checkpoint), flatten(parsed)
    merged, notes = dict(saved), []
    for key, value in saved.items():
        if key in SUPERSEDED and current.get(key) not in (None, value):
            notes.append(f"its weights, not {key}={current[key]}")
        if key in LINKED or key in SUPERSEDED or key not in current:
            continue
        if key in RUNTIME:
            continue
        sequences = isinstance(value, list | tuple) and isinstance(current[key], list | tuple)
        if current[key] == value or (sequences and list(current[key]) == list(value)):
            continue
        if key in typed or any(key.startswith(f"{option}.") for option in typed):  # also --model.transformer={...}
            raise CheckpointError(
                f"--model.{key}={current[key]} contradicts the checkpoint {source}, trained with {key}={value}: "
                "drop the option (the architecture comes from the checkpoint) or pass the matching checkpoint"
            )
        if key in in_configs:
            notes.append(f"{key}={value} (config: {current[key]})")
    # The user's runtime options, also those a checkpoint older than the option does not hold.
    merged.update({key: current[key] for key in RUNTIME & (typed | in_configs) if key in current})
    nested: dict[str, Any] = {}
    for key, value in merged.items():
        *parents, leaf = key.split(".")
        node = nested
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return nested, notes
