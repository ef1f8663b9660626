"""What a replay returns: each variant's figures and output (``VariantResult``), and the run's,
with its fidelity when ``--verify`` ran (``ReplayResult``, and the JSON form ``kvtrace replay``
writes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from kvtrace.events import EngineConfig, Record

if TYPE_CHECKING:
    from kvtrace.replay.lockstep import Fidelity


@dataclass
class VariantResult:
    variant: str
    output: str
    summary: dict[str, Any]
    wall_s: float
    steps: int = 0


@dataclass
class ReplayResult:
    mode: str
    config: EngineConfig
    variants: list[VariantResult]
    fidelity: Fidelity | None = None  # when --verify ran
    fidelity_variant: str = ""
    warnings: list[str] = dataclasses.field(default_factory=list)  # e.g. a truncated source

    def summary_json(self) -> dict[str, Any]:
        fidelity = None
        if self.fidelity is not None:
            fidelity = {"variant": self.fidelity_variant, "matched": self.fidelity.matched,
                        "total": self.fidelity.total, "cut": self.fidelity.cut,
                        "first_divergence": _jsonable(self.fidelity.first_divergence)}
        return {"mode": self.mode,
                "variants": {v.variant: {**v.summary, "wall_s": round(v.wall_s, 3)}
                             for v in self.variants},
                "fidelity": fidelity}


def _jsonable(value: Any) -> Any:
    """A ``lockstep.Divergence`` as JSON builtins; records keep their kind."""
    if isinstance(value, Record):
        return {"kind": type(value).__struct_config__.tag,
                **msgspec.to_builtins(msgspec.structs.asdict(value))}
    if dataclasses.is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return msgspec.to_builtins(value)

