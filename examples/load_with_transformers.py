"""Use a converted checkpoint with nothing but torch and transformers installed.

python examples/load_with_transformers.py ./smol-delta "To be, or not to be"
"""

import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

path = sys.argv[1]
prompt = sys.argv[2] if len(sys.argv) > 2 else "The meaning of life is"

model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)  # runs modeling_deltafy.py
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)  # reads the config too
ids = tokenizer(prompt, return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=40, do_sample=False)
print(tokenizer.decode(out[0], skip_special_tokens=True))
