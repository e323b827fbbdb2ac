"""Convert a model from Python, check it against the original, and save it.

    python examples/convert_in_python.py ./my-llama ./my-llama-delta

The CLI's `deltafy convert` does the same in one line; this shows the library calls underneath.
"""

import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

import deltafy
from deltafy.conversion.verify import make_inputs, record_reference, self_check

source, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(source, dtype="float32")
tokenizer = AutoTokenizer.from_pretrained(source)

reference = record_reference(model, *make_inputs(model, tokenizer))  # the original's outputs
deltafy.convert(model, recipe="ddl-scalar")  # in place: adds the DDL heads, nothing else changes
report = self_check(model, reference)
print(f"max |Δlogits| {report.max_abs_dlogits:.2e}, greedy identical: {report.greedy_identical}")

deltafy.save(model, out, tokenizer=tokenizer, check=report.to_dict())
print(f"saved to {out}; parameters added: {deltafy.summarize(model).params_added:,}")
