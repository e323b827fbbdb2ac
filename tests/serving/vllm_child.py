"""Run a folder through vLLM's offline LLM API in a process of its own (vLLM keeps global engine state) and
print one JSON line: greedy tokens and the log-probs vLLM gave them and the prompts. Usage:
vllm_child.py FOLDER DTYPE PROMPTS_JSON [LLM kwargs as JSON]."""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ["HF_HUB_OFFLINE"] = "1"

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

folder, dtype, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kwargs = {"enforce_eager": True} | (json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})
try:
    llm = LLM(model=folder, dtype=dtype, max_model_len=128, skip_tokenizer_init=True, seed=0, **kwargs)
except Exception as err:  # the test reads what vLLM said
    print("REFUSED", json.dumps(f"{type(err).__name__}: {err}"))
    sys.exit(3)
params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, prompt_logprobs=0, detokenize=False)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
result = []
for prompt, out in zip(prompts, outs, strict=True):
    gen = out.outputs[0]
    result.append(
        {
            "tokens": list(gen.token_ids),
            "logprobs": [lp[t].logprob for t, lp in zip(gen.token_ids, gen.logprobs, strict=True)],
            "prompt_logprobs": [lp[t].logprob for t, lp in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)],
        }
    )
print("RESULT", json.dumps(result))
