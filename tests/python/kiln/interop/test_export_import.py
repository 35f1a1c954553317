"""Export and import in the runtime resolve (no torch): the fp32 round trip is bit-identical, the
folder is what transformers reads (config, generation config, shards, tokenizer), bad input is
refused naming what differs, and nothing is half-written; `eval` scores an exported checkpoint
exactly as its run scored itself. test_hf_parity.py runs the exported folders in transformers'
own Llama."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from kiln_testing.bucket_fixtures import s3_server  # noqa: F401 - a fixture
from kiln_testing.buckets import fresh_url
from kiln_testing.data import STDLIB_TOKENIZER
from kiln_testing.training import (
    EVAL_TASK,
    build_tiny_cache,
    make_spec,
    read_jsonl,
    write_eval_task,
)

from kiln.artifacts.atomic import atomic_write_json
from kiln.artifacts.content import copy_folder_into
from kiln.artifacts.locations import open_store
from kiln.data.tokenizer import load_tokenizer
from kiln.interop.__main__ import main, parse_size
from kiln.interop.errors import InteropError
from kiln.interop.export import write_hf_llama
from kiln.interop.read import read_hf_llama
from kiln.interop.safetensors_folder import INDEX_FILE, read_safetensors, write_safetensors
from kiln.model.config import LlamaConfig
from kiln.model.llama import Llama

VOCAB = 8192  # kiln-stdlib-8k
GQA_UNTIED = LlamaConfig(max_seq_len=32, hidden_dim=32, intermediate_dim=48, num_heads=4,
                         num_kv_heads=2, num_layers=2, vocab_size=VOCAB)  # fmt: skip
MHA_TIED = LlamaConfig(max_seq_len=32, hidden_dim=32, intermediate_dim=48, num_heads=2,
                       num_kv_heads=2, num_layers=3, vocab_size=VOCAB, rope_theta=10000.0,
                       norm_eps=1e-6, tie_embeddings=True, init_std=0.01)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(STDLIB_TOKENIZER)


def random_params(config: LlamaConfig, seed: int) -> dict:
    """Llama(config)'s parameter tree with random float32 values (norm scales too)."""
    structure = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda leaf: rng.standard_normal(leaf.shape, np.float32), structure)


def leaves(params: dict) -> dict[str, np.ndarray]:
    return {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }


@pytest.mark.parametrize("config", [GQA_UNTIED, MHA_TIED], ids=["gqa-untied", "mha-tied"])
def test_kiln_to_hf_to_kiln_is_bit_identical_in_float32(
    config: LlamaConfig, tokenizer: Any, tmp_path: Path
) -> None:
    params = random_params(config, seed=1)
    out = write_hf_llama(tmp_path / "hf", config, params, tokenizer, max_shard_bytes=200_000)
    assert (out / INDEX_FILE).is_file()  # the embedding alone (1 MiB) needs a shard of its own
    imported = read_hf_llama(out, tokenizer=tokenizer.info)
    assert imported.config == config
    original, back = leaves(params), leaves(imported.params)
    assert original.keys() == back.keys()
    for name, value in original.items():
        assert back[name].dtype == np.float32
        assert np.array_equal(back[name], value), name


def test_config_is_explicit_and_read_by_transformers(tokenizer: Any, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out = write_hf_llama(tmp_path / "hf", MHA_TIED, random_params(MHA_TIED, 2), tokenizer)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"]
    assert written["rope_theta"] == written["rope_parameters"]["rope_theta"] == 10000.0
    hf = AutoConfig.from_pretrained(out)
    assert type(hf).__name__ == "LlamaConfig"
    assert (hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers) == (32, 48, 3)
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (2, 2, 16)
    assert (hf.vocab_size, hf.max_position_embeddings) == (VOCAB, 32)
    assert hf.rms_norm_eps == 1e-6 and hf.rope_parameters == {"rope_type": "default",
                                                               "rope_theta": 10000.0}  # fmt: skip
    assert hf.tie_word_embeddings is True and not hf.attention_bias and not hf.mlp_bias
    assert str(hf.dtype).removeprefix("torch.") == "float32"
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (
        hf_tokenizer.bos_token_id, tokenizer.info.eos_id, hf_tokenizer.pad_token_id
    )  # fmt: skip
    generation = GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == tokenizer.info.eos_id
    text = "The tokenizer's files travel with the weights: def f(x):\n    return x ** 2"
    assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    assert len(hf_tokenizer) == VOCAB


def test_shards_hold_at_most_the_limit_and_the_index_lists_every_tensor(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal((i + 1, 100), np.float32) for i in range(8)}
    tensors["big"] = rng.standard_normal((40, 100), np.float32)  # 16000 bytes > the limit
    files = write_safetensors(tmp_path, tensors, max_shard_bytes=6_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert files[-1] == INDEX_FILE and set(index["weight_map"].values()) == set(files[:-1])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for name in files[:-1]:
        from safetensors.numpy import load_file

        shard = load_file(str(tmp_path / name))
        assert sum(t.nbytes for t in shard.values()) <= 6_000 or list(shard) == ["big"]
    back = read_safetensors(tmp_path)
    assert (
        all(np.array_equal(back[k], v) for k, v in tensors.items())
        and back.keys() == tensors.keys()
    )


def test_bfloat16_export_rounds_each_parameter_once(tokenizer: Any, tmp_path: Path) -> None:
    params = random_params(GQA_UNTIED, seed=3)
    out = write_hf_llama(tmp_path / "hf", GQA_UNTIED, params, tokenizer, dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = read_safetensors(out)
    query = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert query.dtype == jnp.bfloat16
    kernel = params["blocks"][1]["attention"]["q_proj"]["kernel"]
    assert np.array_equal(query, kernel.T.astype(jnp.bfloat16))
    back = leaves(read_hf_llama(out).params)
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(np.float32), params)
    assert all(np.array_equal(back[k], v) for k, v in leaves(rounded).items())


# --- refusals -------------------------------------------------------------------------------


def hf_config_folder(tmp_path: Path, config: Any) -> Path:
    """A folder with a config.json written by transformers itself (no weights needed: the
    config is checked first)."""
    folder = tmp_path / type(config).__name__
    config.save_pretrained(folder)
    return folder


SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda t: t.MistralConfig(sliding_window=4096, **SMALL),
         ["model_type='mistral'", "sliding_window=4096"]),
        (lambda t: t.Qwen2Config(**SMALL), ["model_type='qwen2'"]),
        (lambda t: t.LlamaConfig(attention_bias=True, **SMALL), ["attention_bias=true"]),
        (lambda t: t.LlamaConfig(mlp_bias=True, hidden_act="gelu", **SMALL),
         ["mlp_bias=true", "hidden_act='gelu'"]),
        (lambda t: t.LlamaConfig(head_dim=16, **SMALL), ["head_dim=16"]),
        (lambda t: t.LlamaConfig(rope_parameters={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, **SMALL),
         ["rope_parameters.rope_type='llama3'"]),
    ],
    ids=["mistral", "qwen2", "attention-bias", "mlp-bias-and-gelu", "head-dim", "llama3-rope"],
)  # fmt: skip
def test_a_model_that_is_not_a_plain_llama_is_refused_naming_each_difference(
    make: Any, named: list[str], tmp_path: Path
) -> None:
    import transformers

    folder = hf_config_folder(tmp_path, make(transformers))
    with pytest.raises(InteropError, match="is not a plain Llama") as error:
        read_hf_llama(folder)
    for difference in named:
        assert difference in str(error.value)


def test_tensors_that_do_not_match_the_config_are_named(tokenizer: Any, tmp_path: Path) -> None:
    out = write_hf_llama(tmp_path / "hf", GQA_UNTIED, random_params(GQA_UNTIED, 4), tokenizer)
    tensors = read_safetensors(out)
    cases = {
        "missing": ({k: v for k, v in tensors.items() if k != "model.norm.weight"},
                    "missing: model.norm.weight"),
        "bias": ({**tensors, "model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)},
                 "unexpected: model.layers.0.self_attn.q_proj.bias"),
        "shape": ({**tensors, "model.layers.1.mlp.up_proj.weight": np.zeros((32, 48), np.float32)},
                  "tensor model.layers.1.mlp.up_proj.weight has shape (32, 48)"),
    }  # fmt: skip
    for name, (changed, message) in cases.items():
        folder = tmp_path / name
        shutil.copytree(out, folder)
        for old in folder.glob("model*.safetensors*"):
            old.unlink()
        write_safetensors(folder, changed)
        with pytest.raises(InteropError, match=message.replace("(", r"\(").replace(")", r"\)")):
            read_hf_llama(folder)


def test_a_tied_model_may_carry_its_head_only_as_the_embedding(
    tokenizer: Any, tmp_path: Path
) -> None:
    out = write_hf_llama(tmp_path / "hf", MHA_TIED, random_params(MHA_TIED, 5), tokenizer)
    tensors = read_safetensors(out)
    embedding = tensors["model.embed_tokens.weight"]
    (out / "model.safetensors").unlink()
    write_safetensors(out, {**tensors, "lm_head.weight": embedding})
    assert read_hf_llama(out).config.tie_embeddings
    (out / "model.safetensors").unlink()
    write_safetensors(out, {**tensors, "lm_head.weight": embedding + 1})
    with pytest.raises(InteropError, match="lm_head.weight differs"):
        read_hf_llama(out)


def test_a_vocabulary_mismatch_is_refused_both_ways(tokenizer: Any, tmp_path: Path) -> None:
    other = LlamaConfig(**{**GQA_UNTIED.to_json(), "vocab_size": 8000})
    with pytest.raises(
        InteropError, match="vocab_size is 8000 but tokenizer 'kiln-stdlib-8k' has 8192"
    ):
        write_hf_llama(tmp_path / "hf", other, random_params(other, 6), tokenizer)
    assert list(tmp_path.iterdir()) == []
    out = write_hf_llama(tmp_path / "hf", GQA_UNTIED, random_params(GQA_UNTIED, 6), tokenizer)
    smaller = type(tokenizer.info)(**{**tokenizer.info.to_json(), "vocab_size": 8000},
                                   token_byte_lengths=np.zeros(8000, np.int32))  # fmt: skip
    with pytest.raises(
        InteropError, match="vocab_size 8192 but tokenizer 'kiln-stdlib-8k' has 8000"
    ):
        read_hf_llama(out, tokenizer=smaller)


def test_nothing_is_half_written(tokenizer: Any, tmp_path: Path) -> None:
    params = random_params(GQA_UNTIED, seed=7)
    with pytest.raises(ValueError, match="max_shard_bytes"):  # fails inside the staging folder
        write_hf_llama(tmp_path / "hf", GQA_UNTIED, params, tokenizer, max_shard_bytes=0)
    assert list(tmp_path.iterdir()) == []
    write_hf_llama(tmp_path / "hf", GQA_UNTIED, params, tokenizer)
    with pytest.raises(InteropError, match="already exists"):
        write_hf_llama(tmp_path / "hf", GQA_UNTIED, params, tokenizer)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


# --- a trained run, through the command line ------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kiln.train.spec import parse_spec
    from kiln.train.trainer import train

    folder = tmp_path_factory.mktemp("run")
    cache = build_tiny_cache(folder, "tokenized/a", 40, seed=0)
    validation = build_tiny_cache(folder, "tokenized/val", 20, seed=2)
    evals = {"tasks": [{"name": EVAL_TASK, "num_fewshot": 0}], "every": 2,
             "task_paths": [str(write_eval_task(folder / "tasks"))]}  # fmt: skip
    output = folder / "out"
    # Validation and lm-eval at steps 2 and 3, the steps of its checkpoints.
    spec = make_spec(output, {"tokenized/a": cache}, {"tokenized/val": validation},
                     **{"config.num_train_steps": 3, "config.seq_len": 32,
                        "runtime.checkpointer.every": 2, "runtime.validation_every": 2,
                        "config.evals": evals})  # fmt: skip
    output.mkdir()
    atomic_write_json(output / "train_spec.json", spec)  # as kiln.runner does
    train(parse_spec(spec))
    return output


def checkpoint_params(run: Path, step: int) -> dict[str, np.ndarray]:
    """The checkpoint's parameters as the trainer resumes them: the whole train state, optimizer
    included (another path than the export's parameters-only restore)."""
    from kiln.train.checkpoints import Checkpointer
    from kiln.train.mesh import make_mesh
    from kiln.train.spec import load_spec
    from kiln.train.step import ModelOptions, abstract_train_state

    spec = load_spec(run / "train_spec.json")
    model = LlamaConfig.from_json(json.loads((run / "config.json").read_text())["model"])
    cfg = spec.config
    target = abstract_train_state(
        model, cfg.optimizer, cfg.num_train_steps, mesh=make_mesh({"data": -1}),
        options=ModelOptions(cfg.compute_dtype, cfg.param_dtype, attention="xla"),
    )  # fmt: skip
    checkpointer = Checkpointer.from_spec(run, spec.runtime.checkpointer, name=spec.name,
                                          version=spec.version)  # fmt: skip
    try:
        (info,) = (c for c in checkpointer.complete() if c.step == step)
        state = checkpointer.restore(info, target)
    finally:
        checkpointer.close()
    return leaves(nnx.to_pure_dict(jax.device_get(state.params)))


def test_cli_exports_a_checkpoint_exactly(trained_run: Path, tmp_path: Path, capsys: Any) -> None:
    assert main(["export", str(trained_run), str(tmp_path / "last")]) == 0
    assert main(["export", str(trained_run), str(tmp_path / "two"), "--step", "2",
                 "--max-shard-size", "1MB"]) == 0  # fmt: skip
    assert f"to {tmp_path / 'two'}: config.json" in capsys.readouterr().out
    for name, step in (("last", 3), ("two", 2)):
        exported = leaves(read_hf_llama(tmp_path / name).params)
        expected = checkpoint_params(trained_run, step)
        assert exported.keys() == expected.keys()
        assert all(np.array_equal(exported[k], v) for k, v in expected.items()), name
    assert (tmp_path / "two" / INDEX_FILE).is_file() and not (
        tmp_path / "last" / INDEX_FILE
    ).exists()


def test_cli_errors_name_the_problem(trained_run: Path, tmp_path: Path, capsys: Any) -> None:
    assert main(["export", str(trained_run), str(tmp_path / "x"), "--step", "7"]) == 1
    assert "no complete checkpoint at step 7; it has steps [2, 3]" in capsys.readouterr().err
    changed = tmp_path / "changed-tokenizer"
    shutil.copytree(STDLIB_TOKENIZER["path"], changed)
    (changed / "special_tokens_map.json").write_text('{"eos_token": "<|endoftext|>"}')
    assert main(["export", str(trained_run), str(tmp_path / "x"), "--tokenizer", str(changed)]) == 1
    assert "is not the one" in capsys.readouterr().err
    assert main(["export", str(tmp_path), str(tmp_path / "x")]) == 1
    assert "is not an lm_checkpoint's folder" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_run_whose_cache_moved_exports_with_its_tokenizer_named(
    trained_run: Path, tmp_path: Path, capsys: Any
) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    spec = json.loads((run / "train_spec.json").read_text())
    spec["config"]["datasets"][0]["path"] = str(tmp_path / "gone")
    (run / "train_spec.json").write_text(json.dumps(spec))
    assert main(["export", str(run), str(tmp_path / "x")]) == 1
    assert "cannot load the tokenizer of" in capsys.readouterr().err
    tokenizer = ["--tokenizer", STDLIB_TOKENIZER["path"]]
    assert main(["export", str(run), str(tmp_path / "x"), *tokenizer]) == 0
    assert read_hf_llama(tmp_path / "x").config.vocab_size == VOCAB


def test_cli_import_prints_the_build_config_or_the_refusal(
    tokenizer: Any, tmp_path: Path, capsys: Any
) -> None:
    import transformers

    out = write_hf_llama(tmp_path / "hf", MHA_TIED, random_params(MHA_TIED, 8), tokenizer)
    assert main(["import", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "a plain Llama Kiln computes" in printed
    assert f"vocab_size {VOCAB} (the tokenizer 'hf' has as many tokens)" in printed
    assert "      rope_theta=10000.0,\n" in printed and "tie_embeddings=True" in printed
    mistral = hf_config_folder(tmp_path, transformers.MistralConfig(sliding_window=64, **SMALL))
    assert main(["import", str(mistral)]) == 1
    assert "model_type='mistral'" in capsys.readouterr().err


def test_sizes_follow_transformers_units() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("1000") == 1000 and parse_size("500mb") == 500 * 10**6
    for bad in ("0", "5 TB", "-1", "five"):
        with pytest.raises(Exception, match="is not a size"):
            parse_size(bad)


# --- an hf_model target's build: the export as an artifact of the store ---------------------


def export_record(path: Path, version: str = "2026.12.01", dtype: str = "float32") -> Path:
    """The record file the Pants side writes for an hf_model (kiln_pants.hf_model_rules) of the
    checkpoint `checkpoints/run@1`, fingerprint `ckpt-1`."""
    checkpoint = {"input": "checkpoints/run@1", "fingerprint": "ckpt-1"}
    identity = {"kind": "hf_model", "format": 1, "step": "last", "dtype": dtype,
                "checkpoint": checkpoint}  # fmt: skip
    record = {"record_version": 1, "kind": "hf_model", "name": "hf/run", "version": version,
              "fingerprint": f"f-{dtype}", "identity": identity,
              "inputs": [{"ref": checkpoint["input"], "fingerprint": checkpoint["fingerprint"]}],
              "provenance": {"code_digest": "code-a", "lockfile_digest": "lock"}}  # fmt: skip
    path.write_text(json.dumps(record))
    return path


def test_an_export_into_the_store_is_recorded_served_and_drift_checked(
    trained_run: Path, tmp_path: Path, capsys: Any
) -> None:
    run = tmp_path / "checkpoints/run/1"
    shutil.copytree(trained_run, run)
    out = tmp_path / "hf/run/2026.12.01"
    record = export_record(tmp_path / "record.json")
    export = ["export", str(run), str(out), "--record", str(record)]

    atomic_write_json(run / "artifact.json", {"fingerprint": "ckpt-1"})  # RUNNING: no STATUS
    assert main(export) == 1
    assert "holds no finished checkpoints/run@1" in capsys.readouterr().err
    (run / "STATUS").write_text("SUCCESS\n")
    assert main(export) == 0
    assert f"kiln: built hf/run@2026.12.01 at {out}" in capsys.readouterr().out
    stored = json.loads((out / "artifact.json").read_text())
    assert stored["fingerprint"] == "f-float32" and stored["provenance"]["code_digest"] == "code-a"
    assert (out / "STATUS").read_text() == "SUCCESS\n"
    assert read_hf_llama(out).config.vocab_size == VOCAB
    written = (out / "config.json").stat().st_mtime_ns

    assert main(export) == 0  # served: nothing rewritten
    assert "is already built" in capsys.readouterr().out
    assert (out / "config.json").stat().st_mtime_ns == written

    other = export_record(tmp_path / "bf16.json", dtype="bfloat16")
    assert main(["export", str(run), str(out), "--record", str(other)]) == 1
    error = capsys.readouterr().err
    assert "fingerprint f-float32" in error and "differs in: dtype" in error
    assert (out / "config.json").stat().st_mtime_ns == written

    atomic_write_json(run / "artifact.json", {"fingerprint": "retrained"})
    assert main(["export", str(run), str(tmp_path / "y"), "--record", str(record)]) == 1
    assert "but this export is of fingerprint ckpt-1" in capsys.readouterr().err


@pytest.mark.usefixtures("s3_server")
def test_a_run_in_a_bucket_exports_into_the_bucket(
    trained_run: Path, tmp_path: Path, capsys: Any
) -> None:
    """`python -m kiln.interop export` of a run in a bucket, into the bucket (a `pants package`
    of an hf_model with a bucket prefix): the same weights as from the folder, STATUS last."""
    prefix = fresh_url("s3")
    store = open_store(prefix)
    copy_folder_into(store, "checkpoints/run/1", trained_run)
    store.write("checkpoints/run/1/artifact.json", json.dumps({"fingerprint": "ckpt-1"}).encode())
    store.write("checkpoints/run/1/STATUS", b"SUCCESS\n")
    record = export_record(tmp_path / "record.json")
    out = f"{prefix}/hf/run/2026.12.01"
    assert main(["export", f"{prefix}/checkpoints/run/1", out, "--record", str(record)]) == 0
    assert f"kiln: built hf/run@2026.12.01 at {out}" in capsys.readouterr().out
    assert store.read("hf/run/2026.12.01/STATUS").data == b"SUCCESS\n"
    local = tmp_path / "local"
    assert main(["export", str(trained_run), str(local)]) == 0
    downloaded = tmp_path / "downloaded"
    for key in store.keys("hf/run/2026.12.01"):
        store.download(f"hf/run/2026.12.01/{key}", downloaded / key)
    ours, theirs = leaves(read_hf_llama(downloaded).params), leaves(read_hf_llama(local).params)
    assert ours.keys() == theirs.keys()
    assert all(np.array_equal(ours[k], v) for k, v in theirs.items())


def test_a_dev_export_is_rebuilt(trained_run: Path, tmp_path: Path, capsys: Any) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    atomic_write_json(run / "artifact.json", {"fingerprint": "ckpt-1"})
    (run / "STATUS").write_text("SUCCESS\n")
    out = tmp_path / "hf/run/dev"
    record = export_record(tmp_path / "record.json", version="dev")
    export = ["export", str(run), str(out), "--record", str(record)]
    assert main(export) == 0
    (out / "stale").write_text("from the previous export")
    assert main(export) == 0
    assert not (out / "stale").exists() and (out / "STATUS").is_file()
    assert not list(out.parent.glob(".dev.*"))


# --- `eval`: an exported checkpoint scores what its run logged ------------------------------


def logged_metrics(run: Path, step: int) -> dict[str, float]:
    """Everything the run logged at `step` (validation and lm-eval are separate lines)."""
    merged: dict[str, float] = {}
    for record in read_jsonl(run / "metrics.jsonl"):
        if record["step"] == step:
            merged.update(record)
    return merged


def test_cli_eval_of_exports_equals_what_the_run_logged(
    trained_run: Path, tmp_path: Path, capsys: Any
) -> None:
    for step in (2, 3):
        assert main(["export", str(trained_run), str(tmp_path / f"step{step}"),
                     "--step", str(step)]) == 0  # fmt: skip
    capsys.readouterr()
    spec = json.loads((trained_run / "train_spec.json").read_text())
    config = spec["config"]
    assert main([
        "eval", str(tmp_path / "step2"), str(tmp_path / "step3"), "--tasks", EVAL_TASK,
        *("--task-files", config["evals"]["task_paths"][0]),
        *("--validation", config["validation"][0]["path"]),  # named `val`, as the run names it
        *("--seq-len", "32", "--batch-size", "4", "--max-eval-batches", "2"),  # the run's windows
        *("--out", str(tmp_path / "results.json")),
    ]) == 0  # fmt: skip
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[1:] == [str(tmp_path / "step2"), str(tmp_path / "step3")]
    assert any(line.split()[0] == "eval/val/bpb" for line in table.splitlines())
    results = json.loads((tmp_path / "results.json").read_text())["models"]
    for step in (2, 3):
        scored = results[str(tmp_path / f"step{step}")]
        logged = logged_metrics(trained_run, step)
        assert {"eval/val/loss", "eval/val/bpb", f"lm_eval/{EVAL_TASK}/acc"} <= scored.keys()
        # Same float32 parameters (the export is exact), same jitted functions: equal values.
        differing = {
            name: (value, logged.get(name))
            for name, value in scored.items()
            if not name.endswith("seconds") and logged.get(name) != value
        }
        assert not differing, step


def a_different_tokenizer(tmp_path: Path) -> Path:
    """kiln-stdlib-8k with two token ids swapped: as many tokens, other meanings."""
    folder = tmp_path / "swapped-8k"
    shutil.copytree(STDLIB_TOKENIZER["path"], folder)
    definition = json.loads((folder / "tokenizer.json").read_text())
    vocab = definition["model"]["vocab"]
    first, second = (token for token, index in vocab.items() if index in (300, 301))
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (folder / "tokenizer.json").write_text(json.dumps(definition))
    return folder


def test_cli_eval_refuses_bad_input_in_one_line(
    tokenizer: Any, tmp_path: Path, capsys: Any
) -> None:
    import transformers

    config = LlamaConfig(**{**MHA_TIED.to_json(), "max_seq_len": 64})
    out = write_hf_llama(tmp_path / "hf", config, random_params(config, 9), tokenizer)
    swapped = a_different_tokenizer(tmp_path)
    other = build_tiny_cache(tmp_path, "tokenized/other", 5, seed=3,
                             tokenizer={"kind": "local", "path": str(swapped)})  # fmt: skip
    capsys.readouterr()
    refusals = {
        ("--validation", str(other)): "was tokenized with 'swapped-8k' (8192 tokens, digest",
        (): "nothing to score",
        ("--tasks", f"{EVAL_TASK},{EVAL_TASK}"): f"two entries are logged as '{EVAL_TASK}'",
    }
    errors = []
    for arguments, expected in refusals.items():
        assert main(["eval", str(out), *arguments]) == 1
        errors.append(capsys.readouterr().err)
        assert expected in errors[-1], errors[-1]
    assert f"the model in {out} uses 'hf'" in errors[0]
    shutil.rmtree(swapped)  # the cache's tokenizer gone: its definition cannot be compared
    assert main(["eval", str(out), "--validation", str(other)]) == 1
    errors.append(capsys.readouterr().err)
    assert "cannot be loaded here to compare definitions" in errors[-1]
    mistral = hf_config_folder(tmp_path, transformers.MistralConfig(sliding_window=64, **SMALL))
    assert main(["eval", str(mistral), "--tasks", EVAL_TASK]) == 1
    errors.append(capsys.readouterr().err)
    assert "model_type='mistral'" in errors[-1]
    assert all(error.count("\n") == 1 for error in errors), errors  # one line, no traceback
