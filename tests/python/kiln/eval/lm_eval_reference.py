"""The reference side of the lm-eval parity test: lm-eval's own Hugging Face runner.

Runs in the torch-tests PEX (tests/python/kiln/interop:hf-reference, which bundles this module):
`PEX_MODULE=kiln.eval.lm_eval_reference python hf-reference.pex JOBS.json`. JOBS.json is a list
of jobs, each

  {"model": DIR, "task_dir": DIR, "tasks": [NAME, ...], "num_fewshot": {NAME: N},
   "batch_size": B, "dtype": "float32" | "float64", "out": JSON,
   "apply_chat_template": false, "fewshot_as_multiturn": null, "system_instruction": null}

`DIR` is a transformers Llama folder. Each task runs through `lm_eval.simple_evaluate` on
lm-eval's `hf` model (HFLM over AutoModelForCausalLM at the job's dtype, CPU) at its few-shot
count, as `lm_eval --model hf --model_args pretrained=DIR,dtype=D --tasks NAME --num_fewshot N
--include_path DIR [--apply_chat_template [--fewshot_as_multiturn B]] [--system_instruction S]`
runs it (the optional flags: false, as lm-eval's command line defaults it, and none, when
absent), everything else at lm-eval's defaults (max_length from the model's config, prefix token,
seeds). The out file holds,
per task, lm-eval's numeric metrics, every request's arguments and responses, and every token
sequence HFLM scored with its result (SequenceRecorder). One JSON line
per job goes to stdout: what HFLM resolved (max_length, prefix token, BOS).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    # What simple_evaluate(model="hf", model_args=...) builds; built once for all the tasks.
    lm = HFLM(
        pretrained=job["model"], dtype=job["dtype"], device="cpu", batch_size=job["batch_size"]
    )
    recorder = SequenceRecorder(lm)
    manager = TaskManager(include_path=job["task_dir"], include_defaults=False)
    scored: dict[str, Any] = {}
    apply_chat_template = bool(job.get("apply_chat_template", False))
    multiturn = job.get("fewshot_as_multiturn")
    for task in job["tasks"]:
        recorder.sequences.clear()
        results = simple_evaluate(
            model=lm,
            tasks=[task],
            num_fewshot=job["num_fewshot"][task],
            task_manager=manager,
            bootstrap_iters=0,
            log_samples=True,
            apply_chat_template=apply_chat_template,
            fewshot_as_multiturn=apply_chat_template if multiturn is None else bool(multiturn),
            system_instruction=job.get("system_instruction"),
        )
        scored[task] = {
            "metrics": _numeric(results["results"][task]),
            "requests": [
                {"arguments": sample["arguments"], "resps": sample["resps"]}
                for sample in results["samples"][task]
            ],
            "sequences": list(recorder.sequences),
        }
    Path(job["out"]).write_text(json.dumps(scored))
    return {
        "max_length": lm.max_length,
        "prefix_token_id": lm.prefix_token_id,
        "bos_token_id": lm.tokenizer.bos_token_id,
    }


class SequenceRecorder:
    """Keeps every token sequence HFLM scores, in order, without changing what it computes:
    `_loglikelihood_tokens` receives (request or None, context ids, continuation ids) for
    loglikelihood requests and for each rolling window; rolling documents arrive through
    `loglikelihood_rolling`, whose windows follow in document order."""

    def __init__(self, lm: Any) -> None:
        self.sequences: list[dict[str, Any]] = []
        score_tokens, score_rolling = lm._loglikelihood_tokens, lm.loglikelihood_rolling

        def recording_tokens(requests: list, *args: Any, **kwargs: Any) -> list:
            results = score_tokens(requests, *args, **kwargs)
            for (request, context, continuation), (loglikelihood, greedy) in zip(requests, results):
                self.sequences.append(
                    {"request": request, "context": list(context),
                     "continuation": list(continuation), "result": [loglikelihood, greedy]}
                )  # fmt: skip
            return results

        def recording_rolling(requests: list, *args: Any, **kwargs: Any) -> list:
            self.sequences.append({"documents": [request.args[0] for request in requests]})
            return score_rolling(requests, *args, **kwargs)

        lm._loglikelihood_tokens = recording_tokens
        lm.loglikelihood_rolling = recording_rolling


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def main(jobs_file: str) -> None:
    torch.set_num_threads(2)
    for job in json.loads(Path(jobs_file).read_text()):
        print(json.dumps({"model": job["model"], **run_job(job)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
