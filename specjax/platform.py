"""Which JAX platforms a run tries, where specjax must choose for the user.

libtpu is installed beside jax by the `tpu` extra (`pip install 'specjax[tpu]'`) so that
`plan --compiler=tpu` can compile for a TPU topology on a machine without one. JAX then
starts the TPU runtime on every machine, TPU or not, and on one without TPU chips that
runtime writes a screen of errors ("could not determine TPU accelerator type",
"unexpected worker hostname") to stderr before JAX falls back to the CPU: every command
would print it. Where there is no TPU chip (no PCI device of Google's vendor id, as
JAX's own check reads it) and the user has chosen no platforms (JAX_PLATFORMS), the TPU
is left out of the platforms JAX tries (its `jax_platforms` setting too where a script
imported jax before specjax: jax reads the variable once, on import). `plan
--compiler=tpu` reaches libtpu through its compile-only client, which this does not touch."""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import sys

GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips' PCI vendor id


def has_tpu_chip() -> bool:
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(path) as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def gpu_platforms() -> list[str]:
    """The GPU platforms whose JAX plugin is installed (they keep their place before the CPU)."""
    names = {d.metadata["Name"].lower() for d in importlib.metadata.distributions() if d.metadata["Name"]}
    return [p for p in ("cuda", "rocm") if any(n.startswith(f"jax-{p}") for n in names)]


def leave_out_absent_tpu() -> None:
    """Set JAX_PLATFORMS to the installed GPU platforms and the CPU where libtpu is
    installed, no TPU chip is present and the user set none; before JAX makes a backend."""
    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None or has_tpu_chip():
        return
    os.environ["JAX_PLATFORMS"] = ",".join(gpu_platforms() + ["cpu"])
    if "jax" in sys.modules:  # imported already: its setting was read from the environment then
        sys.modules["jax"].config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
