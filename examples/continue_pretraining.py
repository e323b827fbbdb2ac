"""Continue pretraining a converted checkpoint with stock transformers only (no deltafy installed).

    python examples/continue_pretraining.py ./smol-delta corpus.txt ./smol-continued --steps 200 --seq-len 256

Every parameter trains: the pretrained weights and the Deep Delta Learning heads alike. The
checkpoint's own modeling file (loaded with trust_remote_code) is all that is needed, and the
result is saved as the same kind of self-contained folder. `deltafy train` does more (heads-only
or LoRA training, the gates' own learning rate, resumable runs); this shows the plain-HF route.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments


class Blocks(torch.utils.data.Dataset):
    """A text file as fixed blocks of ``seq_len`` tokens (EOS at the end, the ragged tail dropped)."""

    def __init__(self, path: str, tokenizer, seq_len: int):
        with open(path, encoding="utf-8") as fh:
            ids = tokenizer(fh.read(), add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        n = len(ids) // seq_len
        if n == 0:
            raise SystemExit(f"{path} holds {len(ids)} tokens: fewer than one block of --seq-len {seq_len}")
        self.blocks = torch.tensor(ids[: n * seq_len]).view(n, seq_len)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="a converted checkpoint folder")
    parser.add_argument("text_file", help="UTF-8 text to train on")
    parser.add_argument("out_dir", help="where to save the trained checkpoint")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--prompt", default="To be, or not to be")
    args = parser.parse_args()

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, trust_remote_code=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, trust_remote_code=True)
    for p in model.parameters():  # everything trains, the pretrained weights included
        p.requires_grad_(True)

    training = TrainingArguments(
        output_dir=args.out_dir,  # save_strategy "no": only save_model below writes here
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=model, args=training, train_dataset=Blocks(args.text_file, tokenizer, args.seq_len))
    trainer.train()
    trainer.save_model(args.out_dir)  # save_pretrained: weights, config and the modeling file
    tokenizer.save_pretrained(args.out_dir)

    reloaded = AutoModelForCausalLM.from_pretrained(args.out_dir, trust_remote_code=True).eval()
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = reloaded.generate(ids, max_new_tokens=20, do_sample=False)
    print(tokenizer.decode(out[0], skip_special_tokens=True))


if __name__ == "__main__":
    main()
