"""What the CLI tests share: the tiny text config and an interruptible command line."""
from __future__ import annotations

import sys

# tiny with a 512-token vocabulary, for runs that need a tokenizer (saved next to it).
TEXT_CONFIG = '''
import dataclasses
from specjax.config import load_config


def get_config():
    """tiny with a 512-token vocabulary and a tokenizer."""
    tiny = load_config("tiny")
    return dataclasses.replace(tiny, name="tiny_text", tokenizer_vocab=512,
                               target=dataclasses.replace(tiny.target, vocab_size=512),
                               draft=dataclasses.replace(tiny.draft, vocab_size=512))
'''


def interruptible(module: str, *args: str) -> list[str]:
    """`python -m module args`, with Python's Ctrl-C handler installed even if this test
    process inherited SIGINT as ignored (a job started with `&` from a non-interactive
    shell): Python then leaves it ignored in its children too, and a Ctrl-C test would
    wait for a signal that never lands."""
    code = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", code, *args]
