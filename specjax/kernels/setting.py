"""Which CPU kernels a compiled program uses: a static value, part of the program's key.

A `Kernels` value rides in the static (hashable) data of what a program is traced with:
an `LM`'s pytree aux data (the projections and the attention of its forward) and the
`Warp` of a sampling loop (the nucleus cut). Two settings therefore trace and compile two
programs, and nothing is read from the environment while tracing. `DEFAULT` is read once,
when this module is imported, from SPECJAX_KERNELS: unset or 1, every kernel; 0, none; or
a comma-separated list of KERNELS (unknown names are ignored there; `parse`, which command
line flags use, refuses them).
"""
from __future__ import annotations

import dataclasses
import os

KERNELS = ("matmul", "attention", "nucleus")


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Whether each kernel may run where it applies (it also needs the CPU backend, one
    device, float32 and the library built: `dispatch`)."""

    matmul: bool = True
    attention: bool = True
    nucleus: bool = True

    @classmethod
    def of(cls, names) -> "Kernels":
        names = set(names)
        return cls(*(k in names for k in KERNELS))

    @classmethod
    def parse(cls, text: str) -> "Kernels":
        """'on' or '1' (all), 'off' or '0' (none), 'default' (DEFAULT), or KERNELS joined
        by ',' or '+' (a flag that lists settings takes 'matmul+attention'). ValueError
        naming the value and what is allowed for anything else."""
        text = text.strip()
        if text in ("on", "1"):
            return cls()
        if text in ("off", "0"):
            return cls.of(())
        if text == "default":
            return DEFAULT
        names = text.replace("+", ",").split(",")
        if not names or not set(names) <= set(KERNELS):
            raise ValueError(f"kernel setting {text!r}: not on, off, default or a list of {', '.join(KERNELS)}")
        return cls.of(names)

    @classmethod
    def from_env(cls) -> "Kernels":
        text = os.environ.get("SPECJAX_KERNELS", "1").strip()
        if text in ("1", "0", "on", "off"):
            return cls.parse(text)
        return cls.of(text.replace("+", ",").split(","))

    def __str__(self) -> str:
        on = [k for k in KERNELS if getattr(self, k)]
        return "on" if len(on) == len(KERNELS) else "off" if not on else "+".join(on)


DEFAULT = Kernels.from_env()
NONE = Kernels.of(())
