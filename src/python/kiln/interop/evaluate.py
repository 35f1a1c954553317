"""Kiln's evals on a `transformers` Llama folder: `evaluate_hf_llama(folder, request)`.

A published model, or a Kiln checkpoint exported with kiln.interop.export, is scored by the code
a training run evaluates itself with: lm-eval tasks through kiln.eval.harness over
kiln.train.step.make_logprob_fn, validation caches through kiln.eval.validation over
kiln.train.step.make_eval_step. So its metrics carry the names and meaning of a run's summary
(lm_eval/{task}/acc, eval/{name}/loss, eval/{name}/bpb) and the two compare side by side
(docs/interop.md, "Evaluating a Hugging Face model").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kiln.interop.errors import InteropError
from kiln.interop.read import ImportedLlama, read_hf_config, read_hf_llama
from kiln.model.config import LlamaConfig
from kiln.model.llama import abstract_llama

DEFAULT_BATCH_SIZE = 8


@dataclass(frozen=True)
class ValidationCache:
    """A token cache scored for loss and bits-per-byte, logged as eval/{name}/..."""

    name: str
    path: str  # a folder or a bucket URL


@dataclass(frozen=True)
class EvalRequest:
    """What to score. `suite`: the JSON of kiln_contract.evals.EvalSuiteConfig (a run's
    config.evals), or None for no lm-eval tasks. Validation windows are `seq_len` tokens (default:
    the model's max_seq_len), `batch_size` to a batch, the first `max_eval_batches` batches of
    each cache (default: all), as a run with the same seq_len, batch_size and
    runtime.max_eval_batches scores them."""

    suite: Mapping[str, Any] | None = None
    validation: tuple[ValidationCache, ...] = ()
    seq_len: int | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    max_eval_batches: int | None = None
    compute_dtype: str = "float32"


def evaluate_hf_llama(
    folder: Path, request: EvalRequest, *, tokenizer_dir: Path | None = None
) -> dict[str, float]:
    """The metrics of the Llama in `folder` (its own tokenizer, or the one in `tokenizer_dir`).
    Refuses a folder that is not a plain Llama, a validation cache of another tokenizer or
    shorter than one window, and a task that cannot run, before any weights are read."""
    folder = Path(folder)
    config = read_hf_config(folder)  # a model Kiln cannot compute is refused before anything else
    tokenizer = load_folder_tokenizer(tokenizer_dir or folder)
    return evaluate_model(
        config, lambda: read_hf_llama(folder, tokenizer=tokenizer.info), tokenizer, request,
        where=folder,
    )  # fmt: skip


def evaluate_model(
    config: LlamaConfig,
    load: Callable[[], ImportedLlama],
    tokenizer: Any,
    request: EvalRequest,
    *,
    where: Path,
) -> dict[str, float]:
    """The metrics of a model of `config`, whose weights `load` reads once every cache and task
    is known to be usable; `where` names the model in errors."""
    from kiln.train.mesh import make_mesh

    caches = open_validation_caches(request.validation, tokenizer, model_folder=where)
    seq_len = window_length(request, config, where)
    sets = validation_sets(caches, tokenizer.info, seq_len, request)
    if request.suite is not None:
        check_suite(request.suite, model_max_length=config.max_seq_len)
    model = load()
    mesh = make_mesh({"data": -1})
    graphdef, params = placed_model(model, mesh, request.compute_dtype)
    metrics: dict[str, float] = {}
    if sets:
        metrics.update(_validation_metrics(graphdef, params, mesh, sets))
    if request.suite is not None:
        metrics.update(_suite_metrics(graphdef, params, tokenizer, request.suite, model))
    return metrics


def window_length(request: EvalRequest, config: LlamaConfig, folder: Path) -> int:
    """Validation windows are request.seq_len tokens, at most (and by default) the model's."""
    seq_len = request.seq_len or config.max_seq_len
    if seq_len > config.max_seq_len:
        raise InteropError(
            f"--seq-len {seq_len} is longer than {folder} reads (max_position_embeddings "
            f"{config.max_seq_len}); use at most that"
        )
    return seq_len


def check_suite(suite: Mapping[str, Any], *, model_max_length: int) -> None:
    """Loads every task (as a run does when it starts), so that a task that cannot run is
    refused before the weights are read."""
    from kiln.eval.harness import EvalTaskUnavailable, load_suite_tasks
    from kiln.eval.tasks import EvalSuiteConfig
    from kiln_contract.parsing import SpecError

    try:
        load_suite_tasks(EvalSuiteConfig.from_json(dict(suite)), model_max_length=model_max_length)
    except (SpecError, EvalTaskUnavailable) as e:
        raise InteropError(f"--tasks: {e}") from None


def load_folder_tokenizer(folder: Path) -> Any:
    """The tokenizer in `folder` (a kiln.data.tokenizer.LoadedTokenizer)."""
    from kiln.data.errors import KilnDataError
    from kiln.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer({"kind": "local", "path": str(folder)})
    except (KilnDataError, OSError, ValueError) as e:
        raise InteropError(
            f"cannot load the tokenizer in {folder}: {e}; pass the model's tokenizer folder "
            "with --tokenizer DIR"
        ) from None


def open_validation_caches(
    requested: tuple[ValidationCache, ...], tokenizer: Any, *, model_folder: Path
) -> list[tuple[str, Any]]:
    """(name, TokenCache) per requested cache; each must hold token ids of `tokenizer`. A cache
    requested without a name is named as a run names it: the last part of its recorded name."""
    from kiln.data.cache import TokenCache
    from kiln.data.errors import KilnDataError
    from kiln_contract.parsing import SpecError
    from kiln_contract.vocabulary import check_eval_names

    opened = []
    for entry in requested:
        try:
            cache = TokenCache.open(entry.path)
        except (KilnDataError, OSError, ValueError) as e:
            raise InteropError(f"validation cache {entry.name} ({entry.path}): {e}") from None
        check_same_tokenizer(cache, tokenizer, model_folder=model_folder)
        recorded = str(cache.info.get("name", Path(entry.path).name)).split("/")[-1]
        opened.append((entry.name or recorded, cache))
    try:
        check_eval_names("--validation", [name for name, _ in opened])
    except SpecError as e:
        raise InteropError(f"{e}; name them with --validation NAME=DIR") from None
    return opened


def check_same_tokenizer(cache: Any, tokenizer: Any, *, model_folder: Path) -> None:
    """The cache's token ids must mean what the model's do. Equal tokenizer files (the digest)
    are the same tokenizer; so are files that define the same tokenizer (`save_pretrained`
    rewrites the files of the tokenizer it exports, not its vocabulary, merges or rules)."""
    recorded = cache.tokenizer
    if recorded.digest == tokenizer.info.digest:
        return
    theirs, unloadable = _recorded_tokenizer(cache)
    if theirs is not None and _definition(theirs) == _definition(tokenizer):
        return
    why = (
        f" (its tokenizer cannot be loaded here to compare definitions: {unloadable}; pass its "
        "folder with --tokenizer DIR if it is the model's)"
        if unloadable
        else ""
    )
    raise InteropError(
        f"validation cache {cache.path} was tokenized with {recorded.name!r} "
        f"({recorded.vocab_size} tokens, digest {recorded.digest[:12]}) but the model in "
        f"{model_folder} uses {tokenizer.info.name!r} ({tokenizer.info.vocab_size} tokens, "
        f"digest {tokenizer.info.digest[:12]}){why}; score it with a model of that tokenizer, "
        "or retokenize the validation set with the model's"
    )


def _recorded_tokenizer(cache: Any) -> tuple[Any, str]:
    """(the tokenizer the cache records, loaded; None and why when it cannot be)."""
    from kiln.data.errors import KilnDataError
    from kiln.data.tokenizer import load_tokenizer, resolve_tokenizer_spec

    search_from = [Path.cwd()] + ([cache.path] if isinstance(cache.path, Path) else [])
    spec = resolve_tokenizer_spec(cache.info["tokenizer"].get("spec"), search_from)
    try:
        return load_tokenizer(spec), ""
    except (KilnDataError, OSError, ValueError, TypeError) as e:
        return None, str(e)


def _definition(tokenizer: Any) -> Any:
    return json.loads(tokenizer.hf_tokenizer.backend_tokenizer.to_str())


def placed_model(
    model: ImportedLlama, mesh: Any, compute_dtype: str
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, float32 parameters laid out on `mesh` as the trainer shards them)."""
    from kiln.train.mesh import state_shardings

    graphdef, params = abstract_llama(model.config, compute_dtype=compute_dtype)
    shardings = nnx.to_pure_dict(state_shardings(params, mesh))
    placed = jax.tree.map(
        lambda value, sharding: jax.device_put(np.asarray(value, np.float32), sharding),
        dict(model.params),
        shardings,
    )
    nnx.replace_by_pure_dict(params, placed)
    return graphdef, params


def validation_sets(
    caches: list[tuple[str, Any]], tokenizer_info: Any, seq_len: int, request: EvalRequest
) -> list[Any]:
    """The windows a run with this seq_len, batch_size and max_eval_batches validates on."""
    from kiln.data.mixture import MixtureError, fixed_batches
    from kiln.eval.validation import ValidationSet

    sets = []
    for name, cache in caches:
        whole_set = -(-cache.num_windows(seq_len) // request.batch_size)
        num_batches = min(whole_set, request.max_eval_batches or whole_set)
        try:
            batches = fixed_batches(cache, seq_len, request.batch_size, num_batches)
            sets.append(ValidationSet.build(name, batches, tokenizer_info.token_byte_lengths))
        except (MixtureError, ValueError) as e:
            raise InteropError(f"validation cache {name} ({cache.path}): {e}") from None
    return sets


def _validation_metrics(
    graphdef: nnx.GraphDef, params: nnx.State, mesh: Any, sets: list[Any]
) -> dict[str, float]:
    from kiln.eval.validation import validation_metrics
    from kiln.train.step import TrainState, make_eval_step, shard_batch

    # The trainer's eval step reads a TrainState's model; evaluation has no optimizer state.
    state = TrainState(graphdef=graphdef, params=params, opt_state=(), step=jnp.zeros((), jnp.int32))
    eval_step = make_eval_step(mesh=mesh)

    def eval_batch(batch: dict[str, Any]) -> dict[str, Any]:
        return jax.device_get(eval_step(state, shard_batch(batch, mesh)))

    return validation_metrics(eval_batch, sets)


def _suite_metrics(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokenizer: Any,
    suite: Mapping[str, Any],
    model: ImportedLlama,
) -> dict[str, float]:
    from kiln.eval.harness import run_eval_suite
    from kiln.train.step import make_logprob_fn

    logprobs = make_logprob_fn(graphdef, with_is_argmax=True)
    return run_eval_suite(
        lambda tokens: logprobs(params, tokens), tokenizer, dict(suite), step=0,
        model_max_length=model.config.max_seq_len,
    )  # fmt: skip
