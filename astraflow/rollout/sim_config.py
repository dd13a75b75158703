"""Config of the simulated engine (``rollout.engine.type: sim``, section ``rollout.engine.sim``).

A hardware preset (``hardware``) names the serving numbers of one GPU kind; any of them can be
overridden field by field. The presets' numbers and where they come from: ``docs/sim.md``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from astraflow.configbase import Strict


class HardwareProfile(Strict):
    """The serving numbers of one engine replica (one GPU, or the CPU)."""

    model_config = ConfigDict(allow_inf_nan=False)  # an infinite rate or time has no timeline

    single_tokens_per_s: float = Field(gt=0)
    """Decode rate of one request alone in the engine (memory-bandwidth bound)."""
    peak_tokens_per_s: float = Field(gt=0)
    """Aggregate decode rate of a full batch (compute bound): what the requests in flight share."""
    ttft_s: float = Field(ge=0)
    """Time to first token of a short prompt (scheduling + one forward pass)."""
    prefill_tokens_per_s: float = Field(gt=0)
    """Prompt tokens processed per second, added to ``ttft_s`` for long prompts."""
    max_batch: int = Field(ge=1)
    """Requests decoded together; more wait in a queue."""
    load_seconds: float = Field(ge=0)
    """Time to load a new weight version (the version is served after it)."""


#: named hardware profiles (a model of ~8B parameters in bf16; sources in ``docs/sim.md``)
PRESETS: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(single_tokens_per_s=120.0, peak_tokens_per_s=12000.0, ttft_s=0.04,
                            prefill_tokens_per_s=20000.0, max_batch=256, load_seconds=4.0),
    "a100": HardwareProfile(single_tokens_per_s=75.0, peak_tokens_per_s=5000.0, ttft_s=0.07,
                            prefill_tokens_per_s=8000.0, max_batch=256, load_seconds=6.0),
    "cpu": HardwareProfile(single_tokens_per_s=20.0, peak_tokens_per_s=200.0, ttft_s=0.2,
                           prefill_tokens_per_s=500.0, max_batch=16, load_seconds=0.5),
}


class SimEngineConfig(Strict):
    """The simulated engine: no model; it sleeps as a serving engine on ``hardware`` would take."""

    model_config = ConfigDict(allow_inf_nan=False)

    hardware: Literal["h100", "a100", "cpu"] = "h100"
    """The preset whose numbers the engine follows (``docs/sim.md``)."""
    single_tokens_per_s: float | None = Field(default=None, gt=0)
    """Override of the preset's decode rate of one request alone."""
    peak_tokens_per_s: float | None = Field(default=None, gt=0)
    """Override of the preset's aggregate decode rate of a full batch."""
    ttft_s: float | None = Field(default=None, ge=0)
    """Override of the preset's time to first token."""
    prefill_tokens_per_s: float | None = Field(default=None, gt=0)
    """Override of the preset's prefill rate."""
    max_batch: int | None = Field(default=None, ge=1)
    """Override of the preset's batch size."""
    load_seconds: float | None = Field(default=None, ge=0)
    """Override of the preset's weight-load time."""
    length_mean: float = Field(default=256.0, gt=0)
    """Mean response length in tokens (lognormal, before the ``max_new_tokens`` cap)."""
    length_sigma: float = Field(default=0.8, ge=0)
    """Sigma of the log of the response length (0: every response is ``length_mean`` long)."""
    vocab_size: int = Field(default=32000, ge=16)
    """Token ids are drawn from ``[4, vocab_size)`` (0-3 are the sim tokenizer's special tokens)."""
    time_scale: float = Field(default=1.0, gt=0)
    """Simulated seconds per real second: 10 runs the hardware's timeline ten times faster."""

    @field_validator("hardware", mode="before")
    @classmethod
    def _any_case(cls, value):  # a partition's label is written H100 as often as h100
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _rates(self) -> "SimEngineConfig":
        p = self.profile()
        if p.peak_tokens_per_s < p.single_tokens_per_s:
            raise ValueError(f"rollout.engine.sim: peak_tokens_per_s {p.peak_tokens_per_s:g} is below "
                             f"single_tokens_per_s {p.single_tokens_per_s:g}; a batch cannot decode slower "
                             "than one request alone")
        return self

    def profile(self) -> HardwareProfile:
        """The preset with this section's overrides applied."""
        base = PRESETS[self.hardware].model_dump()
        for key in base:
            if getattr(self, key) is not None:
                base[key] = getattr(self, key)
        return HardwareProfile(**base)
