"""Where a stage's step time goes, phase by phase: every step's (or pass's) phases are observed into the
Prometheus histogram stagemesh_stage_step_phase_seconds{phase} (visible in production), and decode steps' are
also kept as running totals (Stage/Info reports them, so a benchmark reads the per-token breakdown of a real
stage process; a prefill chunk, many times longer, would blur it).

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
    """Seconds decode steps (one token each) spent in each phase since the stage started, and how many steps
    they cover; a pass of decode steps only counts as theirs."""

    def __init__(self) -> None:
        self.decode_seconds = dict.fromkeys(PHASES, 0.0)
        self.decode_steps = 0

    def since(self, phase: str, t0: float, decode: bool) -> float:
        """Adds the time from t0 (time.perf_counter()) to now to phase; returns now."""
        now = time.perf_counter()
        _OBSERVE[phase](now - t0)
        if decode:
            self.decode_seconds[phase] += now - t0
        return now
