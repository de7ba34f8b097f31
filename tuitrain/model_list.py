"""What `tuitrain models` prints: the zoo as a table, and what else MODEL may be."""

from __future__ import annotations

from engine.models.zoo import list_models
from tuitrain.formatting import format_count


def model_listing() -> list[str]:
    """One line per zoo model (name, nominal size, parameters, layers, hidden size) under a
    header, then a line on model folders."""
    rows = [
        (
            m.name,
            format_count(m.parameters, nominal=True),
            f"{m.parameters:,}",
            str(m.layers),
            str(m.hidden),
        )
        for m in list_models()
    ]
    header = ("MODEL", "SIZE", "PARAMETERS", "LAYERS", "HIDDEN")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
    lines.append("or a local Hugging Face model folder (config.json + *.safetensors)")
    return lines
