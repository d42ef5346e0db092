"""Serve checkpoints with vLLM and print what it generates; `serving.serve` runs it with the Python of the
virtualenv that `serving.vllm_python` builds (vLLM is no dependency of the tests' own environment).

stdin holds a JSON request: {"models": [DIR, …], "prompts": [TEXT, …], "max_tokens": M, "logprobs": L}.
Each model gets an engine of its own, one after another in this one process: fp32, eager, greedy, every
prompt in one batch. The last line of stdout is `RESULT ` and a JSON object: for every model, for every
prompt, the text, the prompt's and the generated token ids and, per generated token, the top-L {token id:
logprob}; for a model vLLM could not load or run, {"error": its traceback}.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback


def main(request: dict) -> dict:
    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=request["max_tokens"], logprobs=request["logprobs"])
    served = {}
    for model in request["models"]:
        llm = None
        try:
            # one step holds every prompt; the memory profile runs 512 tokens, not the CPU default of 4,096
            llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
                      max_num_batched_tokens=512, max_num_seqs=len(request["prompts"]),
                      distributed_executor_backend="uni")
            outputs = llm.generate(request["prompts"], params, use_tqdm=False)
            served[model] = [_completion(out) for out in outputs]
        except Exception:  # noqa: BLE001 -- reported with this model; the next gets an engine of its own
            served[model] = {"error": traceback.format_exc()[-4000:]}
        del llm
        gc.collect()
    return served


def _completion(out) -> dict:
    completion = out.outputs[0]
    return {"text": completion.text, "prompt_token_ids": list(out.prompt_token_ids),
            "token_ids": list(completion.token_ids),
            "logprobs": [{str(token): entry.logprob for token, entry in step.items()}
                         for step in completion.logprobs]}


if __name__ == "__main__":  # vLLM may start processes of its own, which import this file again
    print("RESULT " + json.dumps(main(json.load(sys.stdin))), flush=True)
