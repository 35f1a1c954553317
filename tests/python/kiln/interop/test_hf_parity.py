"""Logit parity with transformers itself (PyTorch, CPU), not with a re-implementation of it.

Kiln's Llama (float32 compute, XLA attention) and transformers' LlamaForCausalLM, loaded from the
folder Kiln exports (or Kiln imports) with `from_pretrained` as it is, score the same real token
ids: a right-padded batch whose first row fills max_seq_len. Where the attention mask is 1 the
float32 logits agree within 1e-4 and their argmax everywhere, for grouped-query and multi-head
attention, tied and untied embeddings, and two RoPE bases and norm epsilons (the fields whose
transformers defaults differ from Kiln's).

The weights are random but not small (unit-variance activations, norm scales around 1), so logits
spread over several units and a transposed or misplaced tensor shows. transformers runs in its
own process, from the torch-tests resolve: hf_reference.py, built by Pants as a PEX beside this
test (BUILD: runtime_package_dependencies); one process runs every job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from kiln_testing.data import STDLIB_TOKENIZER

from kiln.data.tokenizer import load_tokenizer
from kiln.interop.export import write_hf_llama
from kiln.interop.read import read_hf_llama
from kiln.model.config import LlamaConfig
from kiln.model.llama import Llama

# Where Pants puts :hf-reference for this test (BUILD: runtime_package_dependencies).
REFERENCE_PEX = Path("tests.python.kiln.interop/hf-reference.pex")
VOCAB = 8192  # kiln-stdlib-8k, the tokenizer of the real token ids
MAX_SEQ_LEN = 64
ROW_LENGTHS = (MAX_SEQ_LEN, 41, 17)  # a right-padded batch; the first row is a full window
TOLERANCE = 1e-4
# Rounding the weights to bfloat16 (relative step 2^-8) moves the logits, relative to their
# standard deviation, by 0.7% on average and 6% at most over these ~10^6 logits (measured); the
# bounds leave room for other seeds and shapes. Argmax then agrees at ~97% of positions: bf16
# flips near-ties, so it is not asserted.
BF16_MEAN_BOUND, BF16_MAX_BOUND = 0.02, 0.15

SHAPE = dict(max_seq_len=MAX_SEQ_LEN, hidden_dim=64, intermediate_dim=160, num_layers=2)
EXPORTED = {
    "gqa-untied": LlamaConfig(**SHAPE, num_heads=4, num_kv_heads=2, vocab_size=VOCAB,
                              rope_theta=500000.0, norm_eps=1e-5),
    "gqa-tied": LlamaConfig(**SHAPE, num_heads=8, num_kv_heads=2, vocab_size=VOCAB,
                            rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True),
    "mha-untied": LlamaConfig(**SHAPE, num_heads=4, num_kv_heads=4, vocab_size=VOCAB,
                              rope_theta=10000.0, norm_eps=1e-6),
    "mha-tied": LlamaConfig(**SHAPE, num_heads=2, num_kv_heads=2, vocab_size=VOCAB,
                            rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True),
}  # fmt: skip
# Written by transformers' own save_pretrained (import), one of them sharded.
SAVED_BY_TRANSFORMERS = {
    "gqa-untied-sharded": (dict(num_attention_heads=4, num_key_value_heads=2,
                                tie_word_embeddings=False), "400KB"),
    "mha-tied": (dict(num_attention_heads=4, num_key_value_heads=4,
                      tie_word_embeddings=True), "5GB"),
}  # fmt: skip


def real_tokens(tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """int32 tokens [3, MAX_SEQ_LEN] of English prose (Python's own docs), right-padded with
    EOS, and the 0/1 attention mask of the real tokens."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode(topics["assert"] + topics["pass"])
    tokens = np.full((len(ROW_LENGTHS), MAX_SEQ_LEN), tokenizer.info.eos_id, np.int32)
    mask = np.zeros_like(tokens)
    for row, length in enumerate(ROW_LENGTHS):
        start = 97 * row
        tokens[row, :length] = ids[start : start + length]
        mask[row, :length] = 1
    return tokens, mask


def random_params(config: LlamaConfig, seed: int) -> dict:
    """Kiln's parameter tree with unit-variance projections (std = fan_in^-0.5) and embeddings
    (std = hidden_dim^-0.5, as the reference side draws them) and norm scales 1 +- 0.1."""
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)

    def draw(path: tuple, leaf: Any) -> np.ndarray:
        if path[-1].key == "scale":
            return (1.0 + 0.1 * rng.standard_normal(leaf.shape)).astype(np.float32)
        fan_in = leaf.shape[1] if path[-1].key == "embedding" else leaf.shape[0]
        return (rng.standard_normal(leaf.shape) * fan_in**-0.5).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(nnx.state(abstract)))


def kiln_logits(config: LlamaConfig, params: dict, tokens: np.ndarray) -> np.ndarray:
    model = Llama(config, rngs=nnx.Rngs(0), compute_dtype=jnp.float32,
                  param_dtype=jnp.float32, attention="xla")  # fmt: skip
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, params)
    return np.asarray(nnx.merge(graphdef, state)(jnp.asarray(tokens)))


def run_reference(jobs: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """Runs the jobs in one transformers process; returns its report per job."""
    jobs_file = folder / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    # The PEX's own environment, not this test's (Pants sets PEX_* for the test's PEX); a shared
    # PEX_ROOT keeps what the reference PEX unpacks across runs.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEX")}
    env["PEX_ROOT"] = str(Path(tempfile.gettempdir()) / "kiln-tests-pex-root")
    result = subprocess.run(
        [sys.executable, str(REFERENCE_PEX), str(jobs_file)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, f"the transformers reference failed:\n{result.stderr[-4000:]}"
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def logits_job(folder: Path, name: str, model_dir: Path) -> dict[str, Any]:
    inputs = {"tokens": str(folder / "tokens.npy"), "attention_mask": str(folder / "mask.npy")}
    return {"kind": "logits", "model": str(model_dir), **inputs, "out": str(folder / f"{name}.npy")}


def export_all(folder: Path, tokenizer: Any, tokens: np.ndarray) -> tuple[dict, list[dict]]:
    """Kiln's logits for each EXPORTED model (and a bf16 export of the first), and the jobs
    that score their exports in transformers."""
    kiln, jobs = {}, []
    for seed, (name, config) in enumerate(EXPORTED.items()):
        params = random_params(config, seed)
        kiln[name] = kiln_logits(config, params, tokens)
        jobs.append(
            logits_job(folder, name, write_hf_llama(folder / name, config, params, tokenizer))
        )
        if name == "gqa-untied":
            rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(np.float32), params)
            kiln["bf16-rounded"] = kiln_logits(config, rounded, tokens)
            bf16 = write_hf_llama(folder / "bf16", config, params, tokenizer, dtype="bfloat16")
            jobs.append(logits_job(folder, "bf16", bf16))
    return kiln, jobs


def save_all_jobs(folder: Path) -> list[dict]:
    """Jobs that write the SAVED_BY_TRANSFORMERS folders, then score them."""
    jobs = []
    for seed, (name, (heads, shard_size)) in enumerate(SAVED_BY_TRANSFORMERS.items()):
        config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      max_position_embeddings=MAX_SEQ_LEN, rms_norm_eps=1e-5,
                      rope_theta=500000.0, **heads)  # fmt: skip
        out = folder / f"saved-{name}"
        jobs.append({"kind": "save_random", "config": config, "seed": seed,
                     "max_shard_size": shard_size, "out": str(out)})  # fmt: skip
        jobs.append(logits_job(folder, out.name, out))
    return jobs


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Exports, transformers-written folders, and both sides' logits for all of them."""
    if not REFERENCE_PEX.exists():
        pytest.fail(f"{REFERENCE_PEX} is missing: run this test with `./pants test` (BUILD)")
    folder = tmp_path_factory.mktemp("parity")
    tokenizer = load_tokenizer(STDLIB_TOKENIZER)
    assert tokenizer.info.vocab_size == VOCAB
    tokens, mask = real_tokens(tokenizer)
    np.save(folder / "tokens.npy", tokens)
    np.save(folder / "mask.npy", mask)
    kiln, jobs = export_all(folder, tokenizer, tokens)
    jobs += save_all_jobs(folder)
    reports = run_reference(jobs, folder)
    for name in SAVED_BY_TRANSFORMERS:
        imported = read_hf_llama(folder / f"saved-{name}", tokenizer=tokenizer.info)
        kiln[f"saved-{name}"] = kiln_logits(imported.config, imported.params, tokens)
    hf = {Path(job["out"]).stem: np.load(job["out"]) for job in jobs if job["kind"] == "logits"}
    return {"kiln": kiln, "hf": hf, "mask": mask == 1, "reports": reports, "folder": folder}


def assert_same_logits(kiln: np.ndarray, hf: np.ndarray, mask: np.ndarray) -> None:
    kiln, hf = kiln[mask].astype(np.float64), hf[mask].astype(np.float64)
    difference = np.abs(kiln - hf).max()
    assert difference <= TOLERANCE, f"max |logit difference| {difference:.3g} > {TOLERANCE}"
    agreement = (kiln.argmax(-1) == hf.argmax(-1)).mean()
    assert agreement == 1.0, f"argmax agrees at {agreement:.1%} of positions"
    assert kiln.std() > 0.5  # logits that spread: a wrong mapping could not hide in noise


@pytest.mark.parametrize("name", list(EXPORTED))
def test_exported_folder_in_transformers_gives_kiln_logits(name: str, parity: dict) -> None:
    assert_same_logits(parity["kiln"][name], parity["hf"][name], parity["mask"])


def test_transformers_loads_the_export_as_a_float32_llama(parity: dict) -> None:
    logits = [r for r in parity["reports"] if r["kind"] == "logits"]
    assert len(logits) == len(EXPORTED) + 1 + len(SAVED_BY_TRANSFORMERS)
    assert {(r["class"], r["param_dtype"]) for r in logits} == {
        ("LlamaForCausalLM", "torch.float32")
    }


def test_bfloat16_export_is_the_rounded_model(parity: dict) -> None:
    """transformers on the bf16 folder (upcast to float32) computes Kiln's model with each
    parameter rounded to bf16 once, to the float32 tolerance; against the unrounded model the
    logits move by the stated bound."""
    kiln, hf, mask = parity["kiln"], parity["hf"], parity["mask"]
    assert_same_logits(kiln["bf16-rounded"], hf["bf16"], mask)
    full = kiln["gqa-untied"][mask]
    moved = np.abs(full - hf["bf16"][mask]) / full.std()
    assert 0 < moved.mean() <= BF16_MEAN_BOUND and moved.max() <= BF16_MAX_BOUND, moved.max()


@pytest.mark.parametrize("name", list(SAVED_BY_TRANSFORMERS))
def test_folder_saved_by_transformers_imports_with_its_logits(name: str, parity: dict) -> None:
    assert_same_logits(parity["kiln"][f"saved-{name}"], parity["hf"][f"saved-{name}"],
                       parity["mask"])  # fmt: skip
    files = sorted(p.name for p in (parity["folder"] / f"saved-{name}").iterdir())
    assert ("model.safetensors.index.json" in files) == name.endswith("sharded"), files


def locked_versions(resolve: str) -> dict[str, str]:
    text = Path(f"3rdparty/python/{resolve}.lock").read_text()
    lock = json.loads("".join(line for line in text.splitlines() if not line.startswith("//")))
    (locked,) = lock["locked_resolves"]
    return {r["project_name"]: r["version"] for r in locked["locked_requirements"]}


def test_the_reference_resolve_pins_what_the_runtime_pins() -> None:
    """transformers, tokenizers, safetensors and numpy on the reference side are the runtime's:
    the parity is with the transformers Kiln's runtime reads configs and tokenizers with."""
    runtime, reference = locked_versions("runtime"), locked_versions("torch-tests")
    differing = {n: (runtime[n], v) for n, v in reference.items() if runtime.get(n, v) != v}
    assert not differing, (
        f"torch-tests.lock and runtime.lock differ in {differing} (runtime, torch-tests); run "
        "./pants generate-lockfiles --resolve=torch-tests"
    )
