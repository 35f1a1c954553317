"""`python -m kiln.interop`: Kiln checkpoints <-> Hugging Face `transformers` Llama folders.

  export RUN_DIR OUT [--step last|N] [--dtype float32|bfloat16] [--tokenizer DIR]
         [--max-shard-size 5GB] [--record RECORD.json]
      writes checkpoint N (default: the newest complete one) of the lm_checkpoint folder RUN_DIR
      as a folder that transformers' AutoModelForCausalLM / AutoTokenizer (and vLLM) load.
      With --record (an hf_model target's build), OUT is an artifact of the store: served when
      built with the record's fingerprint, refused when built with another.
  import HF_DIR [--tokenizer DIR]
      reads and checks a transformers Llama folder (config.json + safetensors) and prints the
      `llama(...)` it is in a BUILD file, or what keeps Kiln from computing it.

Exit codes: 0 done; 1 bad input (a one-paragraph message naming what differs, no traceback).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Heavy imports (jax, transformers) after parsing, so `--help` is instant.
    from kiln.interop.errors import InteropError

    try:
        if args.command == "export":
            return _export(args)
        return _import(args)
    except InteropError as e:
        print(f"kiln.interop: error: {e}", file=sys.stderr)
        return 1


def parse_size(text: str) -> int:
    """Bytes from "5GB" (10**9, transformers' convention), "512MiB" (2**20) or "1000"."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in SIZE_UNITS or int(match.group(1)) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write e.g. 5GB, 500MB, 2GiB or a number of bytes"
        )
    return int(match.group(1)) * SIZE_UNITS[unit]


def parse_step(text: str) -> int | str:
    if text == "last":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a step; write `last` or a number")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.interop",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="a checkpoint -> a transformers Llama folder")
    export.add_argument("run_dir", type=Path, help="the lm_checkpoint's folder in the store")
    export.add_argument("out", type=Path, help="the folder to write (must not exist)")
    export.add_argument(
        "--step", type=parse_step, default="last", help="the checkpoint's step, or `last` (default)"
    )
    export.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    export.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="the run's tokenizer folder, when its caches cannot name it",
    )
    export.add_argument(
        "--max-shard-size",
        type=parse_size,
        default="5GB",
        help="largest safetensors shard (default 5GB = 5*10^9 bytes)",
    )
    export.add_argument(
        "--record",
        type=Path,
        default=None,
        help="the artifact record of an hf_model target: export into the artifact store",
    )
    imported = commands.add_parser("import", help="check a transformers Llama folder")
    imported.add_argument("hf_dir", type=Path, help="a folder with config.json and safetensors")
    imported.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="the vocabulary to check against (default: the folder's own)",
    )
    return parser


def _export(args: argparse.Namespace) -> int:
    options = {
        "step": args.step,
        "dtype": args.dtype,
        "tokenizer_dir": args.tokenizer,
        "max_shard_bytes": args.max_shard_size,
    }
    if args.record is not None:
        from kiln.interop.store_export import export_artifact

        print(export_artifact(args.run_dir, args.out, args.record, **options))
        return 0
    from kiln.interop.export import export_run

    out = export_run(args.run_dir, args.out, **options)
    files = sorted(p.name for p in out.iterdir())
    print(f"exported {args.run_dir} ({args.dtype}) to {out}: {', '.join(files)}")
    return 0


def _import(args: argparse.Namespace) -> int:
    from kiln.interop.read import read_hf_llama
    from kiln.model.config import num_parameters

    tokenizer = _tokenizer(args.tokenizer or args.hf_dir, required=args.tokenizer is not None)
    model = read_hf_llama(args.hf_dir, tokenizer=tokenizer.info if tokenizer else None)
    config = model.config
    vocabulary = (
        f"the tokenizer {tokenizer.info.name!r} has as many tokens"
        if tokenizer
        else "no tokenizer checked (the folder has no tokenizer.json)"
    )
    fields = {k: v for k, v in config.to_json().items() if k != "vocab_size"}
    print(
        f"{args.hf_dir}: a plain Llama Kiln computes, {num_parameters(config):,} parameters; "
        f"vocab_size {config.vocab_size} ({vocabulary}).\nIn a BUILD file:\n  llama(\n"
        + "".join(f"      {name}={value!r},\n" for name, value in fields.items())
        + "  )"
    )
    return 0


def _tokenizer(folder: Path, *, required: bool):
    """The tokenizer in `folder`, or None when it has none and none was asked for."""
    from kiln.data.errors import KilnDataError
    from kiln.data.tokenizer import load_tokenizer
    from kiln.interop.errors import InteropError

    if not required and not (folder / "tokenizer.json").is_file():
        return None
    try:
        return load_tokenizer({"kind": "local", "path": str(folder)})
    except (KilnDataError, OSError, ValueError) as e:
        raise InteropError(f"cannot load the tokenizer in {folder}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
