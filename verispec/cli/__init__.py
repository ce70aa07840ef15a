"""Command line: `main` parses (cli/parser.py), runs one command and turns every failure into one line and an exit
code. The commands live by kind: cli/decode.py (generate, chat, serve), cli/bench.py (bench, bench-serve,
search-layerskip), cli/train.py (train, init-random, export); what they read in cli/inputs.py and cli/loading.py, what
they print in cli/output.py. Everything they do is in the Python API."""

from __future__ import annotations

import os
import sys
from typing import NoReturn, Sequence

from verispec.cli import bench, decode, train
from verispec.cli.parser import build_parser
from verispec.errors import InvalidArgumentError, VerispecError
from verispec.models.hf_adapter import transformers_dtype
from verispec.models.native import auto_dtype
from verispec.threads import MAX_THREADS, set_threads


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; 0 on success, 2 for bad input (one line on stderr), 130 after Ctrl-C, 1 for a bug."""
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "threads", None) is not None and not 1 <= args.threads <= MAX_THREADS:  # for every command
            raise InvalidArgumentError(f"--threads must be from 1 to {MAX_THREADS}, got {args.threads}")
        args.auto_dtype = getattr(args, "dtype", None) == "auto"
        if args.auto_dtype:  # the native runtime's choice, as `load`'s; a target transformers runs gets float32 there
            set_threads(args.threads)
            if getattr(args, "backend", None) == "transformers":
                args.dtype = transformers_dtype(args.dtype)
            else:
                args.dtype = auto_dtype(
                    getattr(args, "device", "cpu"),
                    getattr(args, "target", None),
                    quantize=getattr(args, "quantize", None),
                    kv_dtype=getattr(args, "kv_dtype", "auto"),
                )
        code = {
            "generate": decode.generate_command,
            "chat": decode.chat_command,
            "serve": decode.serve_command,
            "bench": bench.bench_command,
            "bench-serve": bench.bench_serve_command,
            "search-layerskip": bench.search_layerskip_command,
            "train": train.train_command,
            "init-random": train.init_random_command,
            "export": train.export_command,
        }[args.command](args)
    except (VerispecError, OSError) as err:
        if isinstance(err, BrokenPipeError):  # the reader went away (e.g. `| head`): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        print(f"verispec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before or after generate's streaming, which prints its own partial stats
        print(file=sys.stderr)  # so that the shell's prompt does not follow ^C on the same line
        return 130
    except Exception as err:  # a bug, not bad input: still one line; VERISPEC_DEBUG=1 shows the traceback
        if os.environ.get("VERISPEC_DEBUG"):
            raise
        print(f"verispec: internal error: {type(err).__name__}: {err} (VERISPEC_DEBUG=1 for details)", file=sys.stderr)
        return 1
    return code or 0


def run() -> NoReturn:
    """The `verispec` command (and `python -m verispec.cli`): `main`, then the process leaves once its output is out.
    Tearing the interpreter down after `import torch` (every module's objects freed one by one) takes a while a user
    waits through and does nothing a finished command needs: nothing of verispec's runs at exit."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # the reader went away, or the stream was closed
            pass
        except OSError as err:  # the output could not be written whole (a full disk): say so, and fail
            os.write(2, f"verispec: error: writing the output: {err}\n".encode())
            code = code or 1
    os._exit(code)
