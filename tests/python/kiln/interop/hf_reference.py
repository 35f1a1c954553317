"""The reference side of the Hugging Face parity test: transformers' own Llama on PyTorch (CPU).

Runs as its own process, from the `torch-tests` resolve (torch is not in the runtime's), built
as a PEX that test_hf_parity.py runs: `python hf_reference.pex JOBS.json`. JOBS.json is a list;
each job is one of

  {"kind": "save_random", "config": {LlamaConfig kwargs}, "seed": S, "max_shard_size": "5GB",
   "out": DIR}
      LlamaForCausalLM(config) with seeded random weights (far from the 0.02 init, so that
      logits spread over several units and every parameter matters), save_pretrained(DIR).
  {"kind": "logits", "model": DIR, "tokens": NPY, "attention_mask": NPY, "out": NPY}
      AutoModelForCausalLM.from_pretrained(DIR) as it is (weights upcast to float32), the
      float32 logits [B, T, V] of the int tokens under the 0/1 attention mask.

It prints one JSON line per job: what it loaded (class, parameter dtype, attention kernel).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


def save_random(job: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(job["seed"])
    model = LlamaForCausalLM(LlamaConfig(**job["config"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
            else:  # embeddings and [out, in] projections: unit-variance outputs
                parameter.normal_(0.0, parameter.shape[1] ** -0.5)
    model.save_pretrained(job["out"], max_shard_size=job.get("max_shard_size", "5GB"))
    return {"saved": job["out"], "files": sorted(p.name for p in Path(job["out"]).iterdir())}


def logits(job: dict[str, Any]) -> dict[str, Any]:
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    model.eval()
    tokens = torch.from_numpy(np.load(job["tokens"])).long()
    mask = torch.from_numpy(np.load(job["attention_mask"])).long()
    with torch.no_grad():
        out = model(input_ids=tokens, attention_mask=mask).logits
    np.save(job["out"], out.float().numpy())
    return {
        "class": type(model).__name__,
        "param_dtype": str(next(model.parameters()).dtype),
        "attention": model.config._attn_implementation,
    }


JOBS = {"save_random": save_random, "logits": logits}


def main(jobs_file: str) -> None:
    torch.set_num_threads(2)
    for job in json.loads(Path(jobs_file).read_text()):
        print(json.dumps({"kind": job["kind"], **JOBS[job["kind"]](job)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
