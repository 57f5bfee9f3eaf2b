"""Where a stage's step time goes, phase by phase: kept as running totals (Stage/Info reports them, so a
benchmark reads the per-step breakdown of a real stage process) and observed into the Prometheus histogram
stagemesh_stage_step_phase_seconds{phase} (so it is visible in production too).

Timers rather than a profiler: they cost ~1 µs a phase, stay on in production, and time exactly the phases
the floor is about; a profiler's hooks on every call would change the very overhead it measures.

Phases: wire_decode (request to model input: tensor decode and checks), assemble (the pass's inputs and step
slices), model (the forward pass), sample (logits to tokens and copies off the device), encode (the result into
the response). On CUDA the model's kernels run asynchronously: their time shows up in sample or encode, where
the first copy to the CPU waits for them. What a token costs beyond these is gRPC, the event loop and the hop.
"""

from __future__ import annotations

import time

from stagemesh import metrics

PHASES = ("wire_decode", "assemble", "model", "sample", "encode")
_OBSERVE = {phase: metrics.STEP_PHASE_SECONDS.labels(phase).observe for phase in PHASES}


class StepTiming:
    """Seconds spent in each phase since the stage started, and how many steps they cover."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds
        _OBSERVE[phase](seconds)

    def since(self, phase: str, t0: float) -> float:
        """Adds the time from t0 (time.perf_counter()) to now to phase; returns now."""
        now = time.perf_counter()
        self.add(phase, now - t0)
        return now
