"""`meshkeeper export-hf CHECKPOINT_DIR OUT_DIR [--dtype bf16]`: a committed checkpoint as a
Hugging Face model directory. The work needs torch and the trainer's model, which the CLI
does not import (it runs on machines without either); it runs worker/hf/export.py in a
process of its own, with this interpreter."""

from __future__ import annotations

import argparse
import subprocess
import sys


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export-hf", help="write a committed checkpoint as a Hugging Face model directory"
    )
    p.add_argument("checkpoint", help="a committed checkpoint step directory")
    p.add_argument("out", help="the directory to write (config.json, *.safetensors, ...)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="default: the training dtype")
    p.set_defaults(fn=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    argv = [sys.executable, "-m", "worker.hf.export", args.checkpoint, args.out]
    argv += ["--dtype", args.dtype] if args.dtype else []
    return subprocess.run(argv).returncode
