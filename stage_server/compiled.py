"""--compile: torch.compile (inductor) of a stage's per-token compute, module by module, with a fallback.

Compiled at module granularity on interfaces that stay put, [T, hidden] in and out: each layer's MLP and
RMSNorms, and the last stage's final norm and LM head. Attention (its KV cache and per-session steps) stays
eager, so a rewrite of it does not meet the compiler. The token dimension is dynamic (dynamo specialises
T=1, a decode pass, apart from T>1), and one graph serves every layer (parameters are graph inputs).

Compilation happens on first call, so the stage's warm-up (stage_server/server.py) runs a decode and a
prefill shape before the stage says SERVING. If that fails, every module goes back to eager, logged once,
and the stage serves as without the flag. On this CPU it does not pay at batch 1 (README, Performance):
each compiled call costs more in guards and wrappers than fusing saves. CUDA graphs are not implemented:
today's attention loops over sessions with per-session cache lengths, which no static graph can hold.
"""

from __future__ import annotations

import logging

from torch import nn

from stage_server.model import MLP, RMSNorm, StageModel

log = logging.getLogger("stagemesh.stage")


def compiled_modules(model: StageModel) -> list[nn.Module]:
    """What --compile compiles: MLPs and norms of every layer, the final norm and the LM head."""
    mods: list[nn.Module] = [m for m in model.modules() if isinstance(m, (MLP, RMSNorm))]
    if model.lm_head is not None:
        mods.append(model.lm_head)
    return mods


def compile_stage(model: StageModel) -> None:
    """Marks the modules for compilation (in place: parameter names stay, nothing compiles yet)."""
    for module in compiled_modules(model):
        module.compile(dynamic=True)


def uncompile_stage(model: StageModel, reason: BaseException) -> None:
    """Back to eager for good (nn.Module.compile keeps the compiled call beside the eager one)."""
    for module in compiled_modules(model):
        module._compiled_call_impl = None
    first_line = (str(reason).strip().splitlines() or [""])[0]
    log.warning(f"--compile: compilation failed ({type(reason).__name__}: {first_line}); serving eager")


def is_compiled(model: StageModel) -> bool:
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in compiled_modules(model))
