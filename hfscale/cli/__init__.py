"""`hfscale` command line: one module per subcommand, each with `add_parser` and `run`."""

from __future__ import annotations

import argparse
import os
import sys

from ..util.errors import HfscaleError

SUBCOMMANDS = ("config", "prove", "doctor", "plan", "profile", "quantize", "eval", "slurm", "tiny", "demo", "experts", "prune", "bench",
               "checkpoint", "data")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = OneLineParser(
        prog="hfscale",
        description="Scale configs, proofs on the real engine, and more for Hugging Face models.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  hfscale config zero3 --num-processes 16 --out-accelerate my_cfgs --out-deepspeed my_cfgs\n"
        "  hfscale prove --config accelerate_configs/zero3.yaml --num-processes 2\n  hfscale demo",
    )
    parser.add_argument("--verbose", action="store_true",
                        help="also show third-party notices hfscale hides by default (hfscale/util/quiet.py lists them); "
                        "accepted anywhere on the command line")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name in SUBCOMMANDS:
        importlib.import_module(f".{name}_cmd", __name__).add_parser(sub)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --verbose, anywhere on the line, is read before any library is imported, so import-time noise is caught too
    if "--verbose" in argv:
        argv = [a for a in argv if a != "--verbose"]
        from ..util.quiet import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"  # what this command launches (ranks, recipes) shows them too
    else:  # the known notices, and transformers' / the Hub's progress bars ("Loading weights") for this process
        from ..util.quiet import quiet_unless_verbose

        quiet_unless_verbose()
    parser = build_parser()
    args = parser.parse_args(argv)
    from ..util.extras import MissingExtra, missing_extra_line

    try:
        return int(args.run(args) or 0)
    except MissingExtra as e:  # already one line: "hfscale quantize --format gguf needs hfscale[edge]: pip install ..."
        print(e, file=sys.stderr)
        return 2
    except ImportError as e:  # an optional dependency imported past the verb's own check
        msg = missing_extra_line(e, f"hfscale {args.command}")
        if msg is None:
            raise
        print(msg, file=sys.stderr)
        return 2
    except HfscaleError as e:
        print(f"hfscale {args.command}: error: {e}", file=sys.stderr)
        return getattr(e, "status", 2)  # 74: a disk that filled while writing (hfscale.data.store)
    except KeyboardInterrupt:
        print("hfscale: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
