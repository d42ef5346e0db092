"""The fast write paths produce the same bytes as the straightforward path and as earlier versions.

Inputs are built without upcycler's writer: numpy draws seeded values and the official `safetensors`
library stores them. Each job (depth, dense-to-moe, merge, HF <-> Orbax; sharded and single-file) runs
through the CLI, and its output is checked three ways:

1. **Golden:** the sha256 of every output file (and of the manifest, with the temporary paths replaced)
   equals what upcycler wrote for the same inputs before the write paths changed (`GOLDEN`, recorded by
   running this file as a script on that version). Orbax writes are compared through their manifest
   (which holds every tensor's sha256) and through the HF checkpoint converted back, because Orbax's own
   metadata files carry timestamps.
2. **Straightforward reference:** every HF shard equals the bytes rebuilt by hand from the output's
   header and the tensors as the official `safetensors` library reads them, and every sha256 in the
   manifest equals `hashlib` over the file (HF) or over the tensor's C-order bytes (Orbax).
3. **Verbatim tensors** of a depth growth and of a conversion hold exactly the source's bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli

from upcycler.families import FAMILIES
from upcycler.layout import declare_params
from upcycler.spec import ModelSpec

SPEC = ModelSpec(family="llama", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=256, tie_embeddings=False)
SHARD = "60KB"  # small enough that every sharded job writes several shards

JOBS: dict[str, list[str]] = {
    "depth": ["depth", "{a}", "{out}", "--layers", "6", "--method", "solar"],
    "depth-sharded": ["depth", "{a}", "{out}", "--layers", "6", "--method", "solar", "--shard-size", SHARD],
    "moe8": ["dense-to-moe", "{a}", "{out}", "--experts", "8", "--topk", "2"],
    "moe16-g4-sharded": ["dense-to-moe", "{a}", "{out}", "--experts", "16", "--topk", "4", "--granularity", "4",
                         "--shard-size", SHARD],
    "merge": ["merge", "{a}", "{b}", "{out}", "--method", "linear", "--weights", "0.25,0.75"],
    "merge-sharded": ["merge", "{a}", "{b}", "{out}", "--method", "linear", "--weights", "0.25,0.75",
                      "--shard-size", SHARD],
    "to-orbax": ["convert", "{a}", "{out}", "--to", "orbax"],
    "moe-to-orbax": ["convert", "{moe}", "{out}", "--to", "orbax"],
}
BACK_TO_HF = {"to-orbax": [], "moe-to-orbax": ["--shard-size", SHARD]}  # Orbax outputs converted back

GOLDEN: dict[str, dict[str, str]] = {  # recorded with upcycler before the write paths changed; the four
    # dense-to-moe manifests re-recorded when the step config gained min_agreement and calibration_sequences
    # became null (its default depends on the use): with those two edits undone they hash to the old digests
    "depth": {
        "upcycler.json":
            "eb6c0f33ff212d2eb61afecd188b5cceb0123df6ad033921209c84a2b2294cc5",
        "config.json":
            "cecf709f934d8a30309ccf8b2bb2de3ac2028e941ba4648af01dd7d93777350a",
        "model.safetensors":
            "28ce48eae6f7343b0d5dbc3395046c8b769f417712766b83dccccfae1f3ca2aa",
    },
    "depth-sharded": {
        "upcycler.json":
            "4130b392397037a53ae18ab65f37fb1de1dfd44bfd5e03056d7af62cf8f96d8f",
        "config.json":
            "cecf709f934d8a30309ccf8b2bb2de3ac2028e941ba4648af01dd7d93777350a",
        "model-00001-of-00010.safetensors":
            "4ee5a62093db1c24784dc5f557bd22e68cd597d68c5ae5be95f5bb2e1c4a8b51",
        "model-00002-of-00010.safetensors":
            "0bb2d179e207ca4297d325b523cb8da0037c691c4b93b6a7ff5302a9250abc8d",
        "model-00003-of-00010.safetensors":
            "aca2316ce4635dde5489476d2ca94976e2c2f7a7232c8ede08e6296b06fab878",
        "model-00004-of-00010.safetensors":
            "27d7602dbaa7fc6b0dfd944b3500ffef65e929f285d85c213c04dfd7c169d391",
        "model-00005-of-00010.safetensors":
            "131d813e7aabab002760f35d3350d1fdeafd6b266ff6c775b15e96efdcc0e5b1",
        "model-00006-of-00010.safetensors":
            "fa30c95efb35395f0e83a614c7f5a48072641ad94c141921eae976e86052534e",
        "model-00007-of-00010.safetensors":
            "25e59ad75a83d8d71341ceb60b571ba649868cbef07b8be3e904ace446371dc7",
        "model-00008-of-00010.safetensors":
            "2f4e90dcb9df397f022552a9118dd31404f1ffa54d5731d8f197ee12caabb02f",
        "model-00009-of-00010.safetensors":
            "555f328e19de7d7914a0b4f10680d134ee89392bdd6b44b91d4a8189e9400a14",
        "model-00010-of-00010.safetensors":
            "8ebf79ba156c8dc245bf41261d23bc825fbee26e424aef2b60212e3cd20f12b4",
        "model.safetensors.index.json":
            "9925018b7d9e9462e3c07bb171fccc71868b20d7ef9a0614d63d680f41e5b25f",
    },
    "moe8": {
        "upcycler.json":
            "76ef805f7b3179c469ed20ae14176ac16d1b8421b27cae1bc28a8877d61bd5bb",
        "config.json":
            "80e07e42932cde987caa1743345bd5e75181e0d2da04d0a61a53255b13d6480a",
        "model.safetensors":
            "e26a60fc84456fb15d241613c42bbd633e6b6361f86961c30b9a5a389bdf9fc7",
    },
    "moe16-g4-sharded": {
        "upcycler.json":
            "39739a17327deccc27c10c36cf19358bae2b2d0e81ce667199ee32b05ec72ffb",
        "config.json":
            "1c404039a3491690e1a3070974d155636a1eaf4936421176d07350766c753d14",
        "model-00001-of-00018.safetensors":
            "4ee5a62093db1c24784dc5f557bd22e68cd597d68c5ae5be95f5bb2e1c4a8b51",
        "model-00002-of-00018.safetensors":
            "27aa1dd957dc6d18e080821877701dc980794e665a71d40a4d45f18e5de0c8e0",
        "model-00003-of-00018.safetensors":
            "c0245c3111ecd0f1c88cfd15711a83c2dcdf429b7c9dd3bb8ae0f37d915faf56",
        "model-00004-of-00018.safetensors":
            "e39b157ade00a97c375cc261d73685b3876dd3adcbe22ccbfde9b32fa6c6fb13",
        "model-00005-of-00018.safetensors":
            "668182a5200a2446be8419c227ac233d1df4cbcb24a458349c3c1e34a97be4ad",
        "model-00006-of-00018.safetensors":
            "00a48e4bea6910abb8743f8266a66663f6ea9743d54b63c6803f479678445517",
        "model-00007-of-00018.safetensors":
            "ab3cbc1aec5e267f2a0f265d284131d929acb5ef83b668b189bd143df2afeddc",
        "model-00008-of-00018.safetensors":
            "a3324fb3b418ecccdf58ec2c4c4aa284aa2c475907ecc6b706f276ca34197304",
        "model-00009-of-00018.safetensors":
            "dbc9245718110c4fb3459aaed2e9e807ee62185c74e72c8ae276ee16fe769041",
        "model-00010-of-00018.safetensors":
            "e4a9219f32b334a85485d276f9c1363064cbee4017737211e480b091398de9c6",
        "model-00011-of-00018.safetensors":
            "cd8151019c290d8d2116ae35a20627d6b7345318ffe2ae0ca6137ea4c17d0605",
        "model-00012-of-00018.safetensors":
            "459c05c6f1fb70e3209615f7a09965929b865278126f47ada0de59905ce60eab",
        "model-00013-of-00018.safetensors":
            "f44ed25da7c840d45df8708d383cfd75e811bb9d624f70781b81d48dc963ba5a",
        "model-00014-of-00018.safetensors":
            "7ae33a7f37f9b6d9d7aa010b41a93f9d4fd65e51908903e749b600c85f59a78e",
        "model-00015-of-00018.safetensors":
            "e00590b53e2c1f4407e8a82aa8c7c7828bad57200e0d8707c928336cec2a24bc",
        "model-00016-of-00018.safetensors":
            "31fa94b0855fb7aa449acbf5ba92f3c971374a066cc765ec5f403db1088435eb",
        "model-00017-of-00018.safetensors":
            "3fb223ba2c7f8091b0cea997f80dc8d265c3ffce382bd2fde0f6845425d56112",
        "model-00018-of-00018.safetensors":
            "8ebf79ba156c8dc245bf41261d23bc825fbee26e424aef2b60212e3cd20f12b4",
        "model.safetensors.index.json":
            "2759381645f6e752b230df655bc2f4998013999aa78ac6fae3b7d875b8c23d45",
    },
    "merge": {
        "upcycler.json":
            "921ec8d3a93e0e9f0a8a6bdda8d2f260ae63ee77b21ee8d3401c93726cee59a9",
        "config.json":
            "42a316ce879c524f24d70e02a87f6151fca363068c4d9e36235b1fbc9f293bd7",
        "model.safetensors":
            "5438d8fa39ef2a65424b22e1091d235e0b8270e41a08b3419477fbf06420edc6",
    },
    "merge-sharded": {
        "upcycler.json":
            "d6cbac468334e734618c9f214fa3903c11a07aad8255c33b2c7664fe07185030",
        "config.json":
            "42a316ce879c524f24d70e02a87f6151fca363068c4d9e36235b1fbc9f293bd7",
        "model-00001-of-00008.safetensors":
            "724a977a366f63a81b0b52f2aa55fadefeb8dad09a85dc102b5df0eef6cff21f",
        "model-00002-of-00008.safetensors":
            "dd1607b483131882fcbcf65c12b2e95ceb0030e5945403b3a5cb49fff7c94c89",
        "model-00003-of-00008.safetensors":
            "a3b0cfe4e3cba92ffd91ffac1528770c081d7f9330a079ab83ae566ca08817e6",
        "model-00004-of-00008.safetensors":
            "20eac5eb8e86cf85f0d5c5345701074af8076b0191e4c8357c7b0b700ee40618",
        "model-00005-of-00008.safetensors":
            "67d5edec812f820dde6bb3a84e1dfdc2e74002fca79aed9d74b35440265791f9",
        "model-00006-of-00008.safetensors":
            "925091822eccd7af9afaa4c2a47bb4a6f08c8e825b4ff3ad63930652bdcf5310",
        "model-00007-of-00008.safetensors":
            "e68370b0c7fb1965d806896c7801a5f711fc30cbaaadf50ab1f5a96442d9dd8a",
        "model-00008-of-00008.safetensors":
            "aa2e93156b3316b02386e0f75d8b8dbe94624184a306d674f0b188ac5cc2d0af",
        "model.safetensors.index.json":
            "93c4a80fdf5cc03acb4349bd376fb0d4cacae66f586fde78f053c57146cd79b2",
    },
    "to-orbax": {
        "upcycler.json":
            "067fc3f6b719562267d8fecc1f6c8e14274ebb76269820eaede6e09bef5e45f2",
    },
    "to-orbax/hf": {
        "upcycler.json":
            "b4e9e8f135b0a044e4c90b5f33a507ca6b959529a96468e7a7efbab9399ec942",
        "config.json":
            "42a316ce879c524f24d70e02a87f6151fca363068c4d9e36235b1fbc9f293bd7",
        "model.safetensors":
            "407061a88d9c4e647170316babfda9eacb89c3304a5f2e695f1d5efbf3546e35",
    },
    "moe-to-orbax": {
        "upcycler.json":
            "e884584a0fe8b5a67ddcd996c86cc01916f3672ddaa799ef9f77bcf4cafbdd16",
    },
    "moe-to-orbax/hf": {
        "upcycler.json":
            "3629ee9432ba49ab51d920776ebdc25b58f56e3116d4124d74717630bd437af8",
        "config.json":
            "6441fe87e222204e5d75e3ece10f0eb4c1614cfa68ef1cc5accb855c248c0aa0",
        "model-00001-of-00020.safetensors":
            "4ee5a62093db1c24784dc5f557bd22e68cd597d68c5ae5be95f5bb2e1c4a8b51",
        "model-00002-of-00020.safetensors":
            "76291a5fade71605d2928f61d6c59cf833f57ee3bb65b501e0231056d82c8103",
        "model-00003-of-00020.safetensors":
            "3980041a3aca4c2159d528cc3428c015ac6715dd0dbdd7bc78a8de30dd559ea4",
        "model-00004-of-00020.safetensors":
            "a166b384d8ba750303fecb77553757fecd847e2bf339740c75ca8db1b9a16c01",
        "model-00005-of-00020.safetensors":
            "b7a484ea6dee2b72574b32c5bced7d48e24360bf3bd6d079168d3d48a6b24cb1",
        "model-00006-of-00020.safetensors":
            "ec39e986f6d22343215436b8d35cb6bd5e2ce273a65ec8fd2066adffe1d58f88",
        "model-00007-of-00020.safetensors":
            "86464207d9b652f8433fad2d3d39b7c346e5cd222318d6453c8a0e5d77fb302e",
        "model-00008-of-00020.safetensors":
            "f9be6093e06714efc35b99305898b50da86a5517e50f276a9114866e40989a17",
        "model-00009-of-00020.safetensors":
            "cfaf274b26b2874ffd32b75e12ea2e359e7794e5100f1f2ad58f0ce68f2e577a",
        "model-00010-of-00020.safetensors":
            "b33aa198898927042e6add9929cbe8a17fce05289a2a4ef9bab04fe292bb8d59",
        "model-00011-of-00020.safetensors":
            "72397b6b4ee28f7824392875c5c625abae1f6c2cc93870f3e9099b564332e4c5",
        "model-00012-of-00020.safetensors":
            "3e6b1df09157fac69ba024bd731372f7280ee1b815ece616093c1a811903e73d",
        "model-00013-of-00020.safetensors":
            "9d685b744dd683b1e1c26d9efc6f360f3d4f0b7f1a4eb86b77b22a4e2d8f2c82",
        "model-00014-of-00020.safetensors":
            "0e01751313d3d81f2bec7f690c3fd46d239fa95c43ac3327e282a38c414f0028",
        "model-00015-of-00020.safetensors":
            "b0dc842a4c7a49d7b3f799588ffc8c909434df66a768e2005565a519bccbe4aa",
        "model-00016-of-00020.safetensors":
            "d0c554007df31652aeaad8576059bdf13bdb54af4edc0dc746c990e6e1f632b4",
        "model-00017-of-00020.safetensors":
            "d6cfff5788a33f12ddc56c1f9bfcfd28bc3f9f48a4a0932ef2fad37040de9354",
        "model-00018-of-00020.safetensors":
            "b9bc4f79236016fb9322c78e250792ae658b4e12456bee387714878b0b8e5ffb",
        "model-00019-of-00020.safetensors":
            "1a2aa6ac49a44b4ac6e794c1ccd6a8f5559f85c8da66ce809baa861c6c73ab49",
        "model-00020-of-00020.safetensors":
            "8ebf79ba156c8dc245bf41261d23bc825fbee26e424aef2b60212e3cd20f12b4",
        "model.safetensors.index.json":
            "e22659be206f038e1bb05d17bfc7353cbab791429dff764b3a9e6d62be48c42a",
    },
}


def _input(path: Path, seed: int) -> Path:
    """A Llama checkpoint of SPEC written by the official safetensors library: seeded bf16 values."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    family = FAMILIES["llama"]
    rng = np.random.default_rng(seed)
    tensors = {}
    for decl in declare_params(SPEC):
        bits = rng.integers(0, 1 << 16, size=decl.shape, dtype=np.uint16)
        bits = (bits & 0x807F) | 0x3C00  # sign and mantissa random, |x| in [2^-7, 2^-6)
        tensors[family.hf_names(decl)[0]] = torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=10000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
                         torch_dtype="bfloat16")
    config.save_pretrained(path)
    return path


def _run(work: Path) -> dict[str, Path]:
    """Every job's output directory (and each Orbax output's HF conversion, as NAME/hf)."""
    a, b = _input(work / "a", 1), _input(work / "b", 2)
    moe = work / "moe"
    run_cli("dense-to-moe", a, moe, "--experts", "4", "--topk", "2", "--no-verify")
    outs = {}
    for name, args in JOBS.items():
        out = work / name
        cmd = [x.format(a=a, b=b, moe=moe, out=out) for x in args]
        run_cli(*cmd, *(["--no-verify"] if cmd[0] in ("depth", "dense-to-moe") else []))
        outs[name] = out
        if name in BACK_TO_HF:
            run_cli("convert", out, work / f"{name}-hf", "--to", "hf", *BACK_TO_HF[name])
            outs[f"{name}/hf"] = work / f"{name}-hf"
    return outs


def _digests(out: Path, work: Path) -> dict[str, str]:
    """sha256 of each file an output holds; the manifest with `work` replaced, without the per-tensor
    xxh3-128 records HF writes added after the goldens were recorded (test 2 checks those against the
    bytes); Orbax: the manifest only."""
    raw = json.loads((out / "upcycler.json").read_text())
    tensors = raw.get("tensors")
    if isinstance(tensors, dict):
        for record in tensors.values():
            record.pop("xxh3_128", None)
        raw["tensors"] = {name: record for name, record in tensors.items() if record}
        if not raw["tensors"]:
            del raw["tensors"]
    manifest = (json.dumps(raw, indent=2) + "\n").replace(str(work), "WORK")
    found = {"upcycler.json": hashlib.sha256(manifest.encode()).hexdigest()}
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        for f in sorted(out.iterdir()):
            if f.is_file() and f.name != "upcycler.json":
                found[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    return found


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    work = tmp_path_factory.mktemp("identical")
    return work, _run(work)


@pytest.mark.parametrize("name", [*JOBS, *(f"{n}/hf" for n in BACK_TO_HF)])
def test_output_bytes_equal_the_earlier_version(outputs, name):
    work, outs = outputs
    assert _digests(outs[name], work) == GOLDEN[name]


def _rebuilt(path: Path) -> bytes:
    """A shard rebuilt the straightforward way: its header as written, then each tensor's bytes as the
    official safetensors library reads them, in offset order."""
    import torch
    from safetensors import safe_open

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    body = bytearray()
    with safe_open(str(path), "pt") as f:
        for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
            tensor = f.get_tensor(name).contiguous()
            body += tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return raw[:8 + n] + bytes(body)


@pytest.mark.parametrize("name", [n for n in JOBS if n not in BACK_TO_HF] + [f"{n}/hf" for n in BACK_TO_HF])
def test_hf_shards_equal_the_straightforward_bytes_and_hashes(outputs, name):
    _, outs = outputs
    out = outs[name]
    records = json.loads((out / "upcycler.json").read_text())["files"]
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 if "sharded" in name or name == "moe-to-orbax/hf" else len(shards) == 1
    for shard in shards:
        assert shard.read_bytes() == _rebuilt(shard), shard.name
    for f in out.iterdir():
        if f.name != "upcycler.json":
            assert records[f.name] == {"bytes": f.stat().st_size,
                                       "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}, f.name
    import torch
    import xxhash
    from safetensors import safe_open

    digests = json.loads((out / "upcycler.json").read_text())["tensors"]
    held = {}  # each tensor's xxh3-128, over its bytes as the official reader gives them
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            for tensor in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                raw = f.get_tensor(tensor).contiguous().view(torch.uint8).numpy().tobytes()
                held[tensor] = {"xxh3_128": xxhash.xxh3_128_hexdigest(raw)}
    assert digests == held


@pytest.mark.parametrize("name", list(BACK_TO_HF))
def test_orbax_tensor_hashes_equal_the_straightforward_hashes(outputs, name):
    from upcycler.io import read_checkpoint

    _, outs = outputs
    ckpt = read_checkpoint(outs[name])
    tensors = json.loads((outs[name] / "upcycler.json").read_text())["tensors"]
    assert set(tensors) == set(ckpt.tensors)
    for key, tensor in ckpt.tensors.items():
        assert tensors[key]["sha256"] == hashlib.sha256(tensor.load().tobytes()).hexdigest(), key


def test_verbatim_tensors_hold_the_source_bytes(outputs):
    """SOLAR growth copies every source tensor into one or two layers; a conversion copies all of them."""
    work, outs = outputs
    source = _stored(work / "a")
    grown = _stored(outs["depth-sharded"])
    assert grown["model.embed_tokens.weight"] == source["model.embed_tokens.weight"]
    assert grown["model.layers.5.input_layernorm.weight"] == source["model.layers.3.input_layernorm.weight"]
    assert _stored(outs["to-orbax/hf"]) == source


def _stored(directory: Path) -> dict[str, bytes]:
    """Every tensor's stored bytes in a directory's shards, sliced from each file by its header's offsets."""
    found = {}
    for shard in directory.glob("*.safetensors"):
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        header.pop("__metadata__", None)
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            found[name] = raw[8 + n + begin:8 + n + end]
    return found


if __name__ == "__main__":  # record GOLDEN with the installed upcycler: python tests/test_write_identical.py DIR
    work = Path(sys.argv[1])
    work.mkdir(parents=True)
    outs = _run(work)
    print(json.dumps({name: _digests(out, work) for name, out in outs.items()}, indent=1))
