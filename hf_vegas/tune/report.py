"""`TuneReport`: what `hf_vegas.tune` measured, what it chose, and why; JSON in and out, and a picture."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..config import VegasConfig


@dataclasses.dataclass
class TuneReport:
    """The result of `hf_vegas.tune`.

    Attributes:
        config (`VegasConfig`): the chosen configuration; pass it as `vegas_config=`.
        grid (`list[dict]`): every configuration run, in order: `step` (which of the three), `gamma`, `sparsity`,
            `tokens_per_iteration`, `iterations`, `predicted_speedup` (traffic model, over the dense path),
            `speedup` (what the choice used: measured, or the prediction), and with measured timing
            `tokens_per_s` and `decode_seconds`.
        chosen (`dict`): the grid entry of the chosen gamma and sparsity (step 3's best).
        dense (`dict` or None): the dense path's `tokens_per_s` and `decode_seconds` (measured timing only).
        timing (`str`): `"measured"` or `"traffic"`: where the speedups come from.
        plateau_sparsity (`float`): the ratio step 1 found, at which step 2 swept gamma.
        note (`str` or None): why the config is the dense path, when no configuration beat it.
        compiled (`dict` or None): with `base_config=VegasConfig(compile=True)` and measured timing, the chosen
            gamma and sparsity and the dense path measured with compiled steps (`tokens_per_s`,
            `dense_tokens_per_s`, `speedup`); the grid itself ran uncompiled.
    """

    config: VegasConfig
    grid: list[dict]
    chosen: dict
    dense: dict | None
    timing: str
    plateau_sparsity: float
    batch: int
    prompt_tokens: int
    max_new_tokens: int
    device: str
    note: str | None = None
    compiled: dict | None = None

    @property
    def predicted_speedup(self) -> float:
        """The traffic model's speedup of the chosen gamma and sparsity over the dense path."""
        return self.chosen["predicted_speedup"]

    @property
    def measured_speedup(self) -> float | None:
        """The measured speedup of the chosen gamma and sparsity over the dense path (None with traffic timing)."""
        return self.chosen["speedup"] if self.timing == "measured" else None

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "config": self.config.to_dict()}

    def save(self, path) -> Path:
        """Write the report as JSON; `TuneReport.load` reads it back."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path) -> TuneReport:
        data = json.loads(Path(path).read_text())
        return cls(**{**data, "config": VegasConfig(**data["config"])})

    def plot(self, path) -> Path:
        """A PNG: tokens per iteration against the sparsity ratio (steps 1 and 3), and the speedup over the dense
        path against gamma (step 2). Needs matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("TuneReport.plot needs matplotlib: `pip install matplotlib`.") from None
        figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for step, marker in (("1", "o"), ("3", "s")):
            rows = [r for r in self.grid if r["step"].startswith(step)]
            if rows:
                label = f"step {step}: gamma {rows[0]['gamma']}"
                left.plot([r["sparsity"] for r in rows], [r["tokens_per_iteration"] for r in rows], marker=marker,
                          label=label)
        left.axvline(self.plateau_sparsity, color="grey", linestyle=":", label="step 1's plateau")
        left.set(xlabel="sparsity ratio", ylabel="tokens per iteration", title="Acceptance")
        left.legend()
        rows = [r for r in self.grid if r["step"].startswith("2")]
        right.plot([r["gamma"] for r in rows], [r["speedup"] for r in rows], marker="o",
                   label=f"sparsity {self.plateau_sparsity:g}")
        right.axhline(1.0, color="grey", linestyle=":", label="dense path")
        right.set(xlabel="gamma", ylabel=f"speedup over dense ({self.timing})", title="Throughput")
        right.legend()
        chose = (f"gamma {self.config.gamma}, sparsity {self.config.sparsity:g}" if self.config.gamma
                 else "the dense path (gamma 0)")
        figure.suptitle(f"hf_vegas.tune: batch {self.batch} x {self.prompt_tokens} tokens on {self.device}; "
                        f"chose {chose}")
        figure.tight_layout()
        path = Path(path)
        figure.savefig(path, dpi=110)
        plt.close(figure)
        return path

    def __str__(self) -> str:
        lines = [f"hf_vegas.tune on {self.device}: batch {self.batch} x {self.prompt_tokens} prompt tokens, "
                 f"{self.max_new_tokens} new tokens per configuration; speedups {self.timing}"]
        lines.append(f"{'step':<30} {'gamma':>5} {'sparsity':>8} {'tok/iter':>8} {'predicted':>9} {'speedup':>8}")
        for r in self.grid:
            lines.append(f"{r['step']:<30} {r['gamma']:>5} {r['sparsity']:>8g} {r['tokens_per_iteration']:>8.2f} "
                         f"{r['predicted_speedup']:>8.2f}x {r['speedup']:>7.2f}x")
        lines.append(f"chosen: {self.config!r}" + (f" ({self.note})" if self.note else ""))
        if self.compiled:
            lines.append(f"compiled (the grid ran uncompiled): gamma {self.compiled['gamma']}, sparsity "
                         f"{self.compiled['sparsity']:g} at {self.compiled['speedup']:.2f}x the compiled dense path")
            ran_eagerly = self.compiled.get("eager_reason") or self.compiled.get("dense_eager_reason")
            if ran_eagerly:  # the compiled steps could not be captured: these are eager numbers
                lines.append(f"  but its steps ran eagerly: {ran_eagerly}")
        return "\n".join(lines)
