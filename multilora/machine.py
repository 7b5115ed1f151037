"""The machine a figure or a run was measured on, as the dtype policy sees it.

`machine()` is what every benchmark's JSON records under "machine" (`bench.write_result`)
and what a study writes beside each trained run (`study_trained.json`), so that a figure
or a run says which CPU kind it came from.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> dict:
    """The CPU a figure was measured on: model, cores, and the flags that decide the base's
    dtype (`avx512_bf16`, `amx_bf16`: bf16 runs natively; without them bf16 is emulated and
    `model.dtype: auto` runs fp32), and an instruction-set cap set in the environment. The
    kind is the one `model.dtype: auto` sees (`multilora.model.bf16_is_fast`)."""
    from multilora.model import bf16_is_fast, isa_cap, proc_cpu_flags  # torch: not before `bench.use_allocator`

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
                break
    except OSError:
        pass
    flags = proc_cpu_flags()
    return {"cpu_model": model, "cpu_count": os.cpu_count(),
            "cpu_bf16_flags": [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags],
            "isa_cap": isa_cap(), "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
            "cpu_kind": "bf16" if bf16_is_fast("cpu") else ("avx2" if "avx2" in flags else "other")}
