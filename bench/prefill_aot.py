"""Compile `upcycle eval`'s TPU prefill (FlexPrefill through splash attention) for one chip, from this host.

    python bench/prefill_aot.py                                   # SmolLM2-135M: v5e, v6e x 32k, 128k x 1, 4
    python bench/prefill_aot.py --chips v5e --lengths 32k --batches 4 --model DIR

For each (chip, batch, prompt length): one JSON line with the compiled peak per chip (arguments, weights
included, plus temporaries plus outputs) against the chip's HBM, whether it fits, and the compile time; a
program the compiler refuses as over the chip's HBM is `fits: false` with the compiler's line.
The model's weights are abstract (its config.json alone), fp32 as `upcycle eval` runs them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from upcycler.io.hf_read import read_spec
from upcycler.train.aot.prefill import compile_prefill
from upcycler.train.config import ModelConfig
from upcycler.train.evaluation.long_eval import parse_lengths

SMOLLM2 = Path(__file__).parent / "configs" / "models" / "smollm2-135m"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=SMOLLM2, help="an HF directory (config.json is enough)")
    parser.add_argument("--chips", default="v5e,v6e")
    parser.add_argument("--lengths", default="32k,128k")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--attention", default="flexprefill", choices=("flexprefill", "einsum"))
    args = parser.parse_args()
    spec = read_spec(args.model)
    cfg = ModelConfig(compute_dtype="float32", attention=args.attention)
    for chip in args.chips.split(","):
        for length in parse_lengths(args.lengths):
            for batch in (int(b) for b in args.batches.split(",")):
                start = time.perf_counter()
                line = {"bench": "prefill_aot", "model": args.model.name, "attention": args.attention, "chip": chip,
                        "batch": batch, "length": length}
                try:
                    compiled = compile_prefill(spec, cfg, chip=chip, batch=batch, length=length)
                except jax.errors.JaxRuntimeError as err:  # the compiler refuses a program over the chip's HBM
                    if "RESOURCE_EXHAUSTED" not in str(err):
                        raise
                    line.update(fits=False, error=str(err).splitlines()[0][:300])
                else:
                    line.update(peak_gib=round(compiled.peak_bytes / 2**30, 2),
                                hbm_gib=round(compiled.hbm_bytes / 2**30, 2), fits=compiled.fits)
                print(json.dumps({**line, "compile_s": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
