"""Train the bundled demo model: a small dense Llama on the bundled corpus (code, prose, math).

Uses PyTorch and transformers (the project's test dependencies) so the bundled parent is a genuine
Hugging Face checkpoint trained by the reference implementation; upcycler then upcycles and trains it
in JAX. Reproducible from `--seed` on the same library versions. Run `build_demo_corpus.py` first.

    python scripts/train_demo_model.py --steps 1200
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

DEMO = Path(__file__).resolve().parents[1] / "upcycler" / "data" / "demo"
ARCH = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 1024, "tie_word_embeddings": True, "rope_theta": 10000.0}
WEIGHTS = {"code": 0.5, "prose": 0.3, "math": 0.2}


def token_streams(tokenizer_path: Path) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id("<|endoftext|>")
    streams = {}
    for name in WEIGHTS:
        ids: list[int] = []
        for line in (DEMO / "corpus" / f"{name}.train.jsonl").read_text().splitlines():
            ids += tok.encode(json.loads(line)["text"]).ids + [eos]
        streams[name] = np.asarray(ids, dtype=np.int64)
    return streams


def batch(streams: dict[str, np.ndarray], rng: np.random.Generator, size: int, length: int) -> np.ndarray:
    names = list(WEIGHTS)
    picks = rng.choice(len(names), size=size, p=[WEIGHTS[n] for n in names])
    rows = []
    for k in picks:
        s = streams[names[k]]
        start = rng.integers(0, len(s) - length - 1)
        rows.append(s[start:start + length + 1])
    return np.stack(rows)


def main() -> None:
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    streams = token_streams(DEMO / "tokenizer.json")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), bos_token_id=eos, eos_token_id=eos,
                                      pad_token_id=eos, **ARCH)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    model.train()
    for step in range(args.steps):
        ids = torch.as_tensor(batch(streams, rng, args.batch, args.length))
        loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    out = DEMO / "model"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((DEMO / name).read_bytes())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
