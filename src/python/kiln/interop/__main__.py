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
  eval HF_DIR [HF_DIR ...] [--tasks NAME[:SHOTS],...|core] [--task-files DIR ...]
       [--max-examples N] [--validation [NAME=]CACHE_DIR ...] [--seq-len N] [--batch-size N]
       [--max-eval-batches N] [--compute-dtype float32|bfloat16] [--tokenizer DIR]
       [--out RESULTS.json]
      scores each transformers Llama folder with the lm-eval tasks and validation caches a
      training run evaluates itself with (same code, same metric names) and prints a table with
      a column per folder; --out also writes every metric as JSON.
  eval-artifact OUT --record RECORD.json --prefix PREFIX [--validation NAME=CACHE ...]
       [--task-files DIR ...]
      an lm_eval_run target's build (kiln.interop.eval_artifact): the evaluation its record
      describes, into OUT in the artifact store at PREFIX; served when built.

Exit codes: 0 done; 1 bad input (a one-paragraph message naming what differs, no traceback).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from kiln_contract.location import location_argument

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Heavy imports (jax, transformers) after parsing, so `--help` is instant.
    from kiln.interop.errors import InteropError

    try:
        if args.command == "export":
            return _export(args)
        if args.command == "eval":
            return _eval(args)
        if args.command == "eval-artifact":
            return _eval_artifact(args)
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
    export.add_argument(
        "run_dir", type=location_argument, help="the lm_checkpoint's folder in the store (or its URL)"
    )
    export.add_argument(
        "out", type=location_argument, help="the folder to write, which must not exist (with --record: "
        "its place in the store, a folder or a URL)"
    )
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
    _add_eval_parser(commands)
    _add_eval_artifact_parser(commands)
    return parser


def parse_tasks(text: str) -> list[dict[str, Any]]:
    """lm-eval task entries from "hellaswag:10,arc_easy" (0 shots unless given) or "core"."""
    from kiln_contract.evals import CORE_TASKS

    if text.strip() == "core":
        return [task.to_json() for task in CORE_TASKS]
    tasks = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, shots = item.partition(":")
        if not name or (shots and not shots.isdigit()):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a task; write NAME or NAME:SHOTS (e.g. hellaswag:10), or `core`"
            )
        tasks.append({"name": name, "num_fewshot": int(shots or 0)})
    if not tasks:
        raise argparse.ArgumentTypeError("--tasks names no task")
    return tasks


def parse_validation(text: str) -> Any:
    """A validation cache from "NAME=DIR" or "DIR" (named like a run names it: the last part
    of its cache name)."""
    from kiln.interop.evaluate import ValidationCache

    name, sep, path = text.partition("=")
    if not sep:
        return ValidationCache(name="", path=text)
    if not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=CACHE_DIR or CACHE_DIR")
    return ValidationCache(name=name, path=path)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def _add_eval_parser(commands: Any) -> None:
    evaluate = commands.add_parser(
        "eval", help="score transformers Llama folders with Kiln's evals, side by side"
    )
    evaluate.add_argument("hf_dirs", type=Path, nargs="+", metavar="HF_DIR",
                          help="a transformers Llama folder (config, safetensors, tokenizer)")
    evaluate.add_argument(
        "--tasks", type=parse_tasks, default=None,
        help="lm-eval tasks: NAME[:SHOTS],... or `core` (the DCLM CORE suite)",
    )  # fmt: skip
    evaluate.add_argument(
        "--task-files", type=Path, action="append", default=[], metavar="DIR",
        help="a folder of local lm-eval task YAML (repeatable)",
    )  # fmt: skip
    evaluate.add_argument("--max-examples", type=positive_int, default=None, metavar="N",
                          help="score at most N documents per task")  # fmt: skip
    evaluate.add_argument(
        "--validation", type=parse_validation, action="append", default=[],
        metavar="[NAME=]CACHE_DIR", help="a token cache for eval/NAME/loss and bpb (repeatable)",
    )  # fmt: skip
    evaluate.add_argument("--seq-len", type=positive_int, default=None, metavar="N",
                          help="validation window length (default: the model's max_seq_len)")
    evaluate.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                          help="validation windows per batch (default 8)")
    evaluate.add_argument("--max-eval-batches", type=positive_int, default=None, metavar="N",
                          help="validation batches per cache (default: all its windows)")
    evaluate.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32")
    evaluate.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                          help="the models' tokenizer folder (default: each folder's own)")
    evaluate.add_argument("--out", type=Path, default=None, metavar="RESULTS.json",
                          help="write all metrics as JSON")


def _add_eval_artifact_parser(commands: Any) -> None:
    built = commands.add_parser("eval-artifact", help="an lm_eval_run's build, into the store")
    built.add_argument("out", help="the evaluation's folder in the store (a path or a URL)")
    built.add_argument("--record", type=Path, required=True, metavar="RECORD.json")
    built.add_argument("--prefix", required=True, help="the artifact store its model is in")
    built.add_argument(
        "--validation", type=parse_validation, action="append", default=[],
        metavar="NAME=CACHE", help="where each validation cache of the record is (repeatable)",
    )  # fmt: skip
    built.add_argument("--task-files", type=Path, action="append", default=[], metavar="DIR",
                       help="a folder of the suite's local lm-eval task YAML (repeatable)")


def _eval_artifact(args: argparse.Namespace) -> int:
    from kiln.artifacts.locations import open_store
    from kiln.interop.eval_artifact import evaluate_artifact

    task_paths = tuple(str(folder.resolve()) for folder in args.task_files)
    print(evaluate_artifact(args.out, args.record, open_store(args.prefix),
                            tuple(args.validation), task_paths))  # fmt: skip
    return 0


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
    from kiln.artifacts.folder import ArtifactFolder
    from kiln.interop.errors import InteropError
    from kiln.interop.export import export_run
    from kiln.train.run_mirror import local_run

    if not isinstance(args.out, Path):
        raise InteropError(
            f"export: {args.out} is in a bucket: an export into the artifact store is an "
            "hf_model artifact (`./pants package` its target, or give --record)"
        )
    with local_run(ArtifactFolder.at(args.run_dir), args.step) as run:
        out = export_run(run, args.out, **options)
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


def _eval(args: argparse.Namespace) -> int:
    from kiln.artifacts.atomic import atomic_write_json
    from kiln.interop.errors import InteropError
    from kiln.interop.evaluate import EvalRequest, evaluate_hf_llama

    if args.tasks is None and not args.validation:
        raise InteropError("eval needs --tasks, --validation or both: nothing to score")
    request = EvalRequest(
        suite=_suite(args),
        validation=tuple(args.validation),
        seq_len=args.seq_len,
        max_eval_batches=args.max_eval_batches,
        compute_dtype=args.compute_dtype,
        **({"batch_size": args.batch_size} if args.batch_size else {}),
    )
    results = {
        str(folder): evaluate_hf_llama(folder, request, tokenizer_dir=args.tokenizer)
        for folder in args.hf_dirs
    }
    print(format_table(results))
    if args.out is not None:
        atomic_write_json(args.out, {"models": results})
    return 0


def _suite(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.tasks is None:
        return None
    return {
        "tasks": args.tasks,
        "every": 1,
        "max_examples": args.max_examples,
        "task_paths": [str(folder.resolve()) for folder in args.task_files],
    }


def format_table(results: dict[str, dict[str, float]]) -> str:
    """One row per metric (timings left out), one column per model."""
    names = sorted({name for metrics in results.values() for name in metrics
                    if not name.endswith("seconds")})  # fmt: skip
    width = max(map(len, ["metric", *names]))
    columns = list(results)
    lines = ["  ".join([f"{'metric':<{width}}", *columns])]
    for name in names:
        cells = [_cell(results[model].get(name), len(model)) for model in columns]
        lines.append("  ".join([f"{name:<{width}}", *cells]))
    return "\n".join(lines)


def _cell(value: float | None, width: int) -> str:
    text = "n/a" if value is None else f"{value:.4f}"
    return f"{text:>{max(width, 10)}}"


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
