"""What every entry point shares: `--config=NAME` with `--config.a.b=value` overrides,
and bad input reported as one line on stderr with exit code 2 (never a traceback).

    def main(argv): config = cli.config(); ...
    if __name__ == "__main__": cli.run(main)
"""
from __future__ import annotations

import sys
from typing import Callable

from absl import app, flags

from specjax.config import Config, UsageError, load_config

FLAGS = flags.FLAGS
_OVERRIDES: list[str] = []


def define_config_flag(default: str) -> None:
    flags.DEFINE_string("config", default, "Config name (configs/NAME.py) or path to a config file. "
                        "Override fields with --config.FIELD.SUB=VALUE, e.g. --config.sampling.lookahead=3.")


def _parse(argv: list[str]) -> list[str]:
    rest = [argv[0]]
    for arg in argv[1:]:
        if arg.startswith("--config."):
            _OVERRIDES.append(arg[len("--config."):])
        else:
            rest.append(arg)
    try:
        return FLAGS(rest)
    except flags.Error as e:
        fail(str(e))


def fail(message: str) -> None:
    prog = sys.argv[0].rsplit("/", 1)[-1]
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def config() -> Config:
    """The run's Config: FLAGS.config plus the command line's overrides, validated."""
    return load_config(FLAGS.config, _OVERRIDES)


def run(main: Callable[[list[str]], None]) -> None:
    def guarded(argv):
        try:
            main(argv)
        except UsageError as e:
            fail(str(e))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    app.run(guarded, flags_parser=_parse)
