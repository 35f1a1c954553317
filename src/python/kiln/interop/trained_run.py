"""What an export reads from an lm_checkpoint's folder (docs/artifacts.md, docs/training.md):
the step spec (train_spec.json), the model config the run resolved (config.json), its complete
checkpoints, the parameters of one of them, and the tokenizer of its dataset caches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.artifacts import TRAIN_SPEC_FILE
from kiln.interop.errors import InteropError
from kiln.interop.llama_weights import Params
from kiln.model.config import LlamaConfig
from kiln.train.checkpoints import Checkpointer, CheckpointInfo
from kiln_contract.layout import RUN_CONFIG_FILE


@dataclass
class TrainedRun:
    path: Path
    spec: Any  # kiln.train.spec.TrainSpec
    model_config: LlamaConfig
    tokenizer_record: dict[str, Any]  # what the run recorded: name, digest, vocab_size, ...
    checkpointer: Checkpointer
    chat_template: str | None  # the BUILD file's template of the chats it trained on

    @classmethod
    def open(cls, path: Path) -> TrainedRun:
        from kiln.train.spec import SpecError, load_spec

        if not (path / TRAIN_SPEC_FILE).is_file() or not (path / RUN_CONFIG_FILE).is_file():
            raise InteropError(
                f"{path} is not an lm_checkpoint's folder (it needs {TRAIN_SPEC_FILE} and "
                f"{RUN_CONFIG_FILE}, which a run writes when it starts)"
            )
        try:
            spec = load_spec(path / TRAIN_SPEC_FILE)
            resolved = json.loads((path / RUN_CONFIG_FILE).read_text())
            model_config = LlamaConfig.from_json(resolved["model"])
            tokenizer_record = dict(resolved["tokenizer"])
        except (SpecError, ValueError, KeyError, TypeError) as e:
            raise InteropError(f"{path}: cannot read the run's config: {e}") from None
        checkpointer = Checkpointer.from_spec(
            path, spec.runtime.checkpointer, name=spec.name, version=spec.version
        )
        chat_template = resolved.get("chat_template")
        return cls(path, spec, model_config, tokenizer_record, checkpointer, chat_template)

    def checkpoint(self, step: int | str) -> CheckpointInfo:
        """The complete checkpoint at `step`, or the newest one for "last" (a permanent one wins
        over a temporary one of the same step)."""
        complete = self.checkpointer.complete()
        if not complete:
            raise InteropError(
                f"{self.path} has no complete checkpoint (a checkpoints/step-N folder with "
                "metadata.json); train it first"
            )
        if step == "last":
            return complete[-1]
        matches = [c for c in complete if c.step == step]
        if not matches:
            steps = sorted({c.step for c in complete})
            raise InteropError(
                f"{self.path} has no complete checkpoint at step {step}; it has steps {steps}"
            )
        return matches[-1]

    def tokenizer(self, folder: Path | None = None) -> Any:
        """The run's tokenizer (a LoadedTokenizer): from `folder` if given, else as its first
        dataset cache names it. It must be the one the run recorded (same digest); it carries
        the chat template the run's chat caches were given."""
        from kiln.data.errors import KilnDataError
        from kiln.data.tokenizer import load_tokenizer

        try:
            spec = {"kind": "local", "path": str(folder)} if folder else self._cache_tokenizer()
            loaded = load_tokenizer(spec)
        except (KilnDataError, OSError, ValueError) as e:
            raise InteropError(
                f"cannot load the tokenizer of {self.path}: {e}. Pass the folder of the "
                "tokenizer the run was trained with (--tokenizer DIR)"
            ) from None
        recorded = self.tokenizer_record
        if loaded.info.digest != recorded.get("digest"):
            raise InteropError(
                f"tokenizer {loaded.info.name!r} ({loaded.info.vocab_size} tokens, digest "
                f"{loaded.info.digest[:12]}) is not the one {self.path} was trained with "
                f"({recorded.get('name')!r}, {recorded.get('vocab_size')} tokens, digest "
                f"{str(recorded.get('digest'))[:12]})"
            )
        if self.chat_template is not None:  # what its chats were rendered with, for its export
            loaded.hf_tokenizer.chat_template = self.chat_template
        return loaded

    def _cache_tokenizer(self) -> Any:
        from kiln.data.cache import TokenCache
        from kiln.data.tokenizer import resolve_tokenizer_spec

        cache_path = Path(self.spec.config.datasets[0].path)
        cache = TokenCache.open(cache_path)
        return resolve_tokenizer_spec(
            cache.info["tokenizer"].get("spec"), [Path.cwd(), self.path, cache_path]
        )

    def params(self, checkpoint: CheckpointInfo) -> Params:
        return _restore_params(self.spec, self.model_config, self.checkpointer, checkpoint)

    def close(self) -> None:
        self.checkpointer.close()


def _restore_params(
    spec: Any, model_config: LlamaConfig, checkpointer: Checkpointer, checkpoint: CheckpointInfo
) -> Params:
    """The parameters saved at `checkpoint`, as numpy arrays in Kiln's parameter tree, laid out
    on a mesh over this machine's devices (not the run's, which may need more)."""
    import jax
    from flax import nnx

    from kiln.train.checkpoint_params import restore_params
    from kiln.train.mesh import make_mesh

    cfg = spec.config
    try:
        _, params = restore_params(
            checkpoint, model_config, mesh=make_mesh({"data": -1}),
            compute_dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype,
        )  # fmt: skip
    except Exception as e:  # orbax raises many types; all mean "not this run's state"
        raise InteropError(f"cannot restore {checkpoint.path}: {e}") from None
    return nnx.to_pure_dict(jax.device_get(params))
