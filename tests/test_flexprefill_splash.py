"""FlexPrefill on a TPU (`flexprefill_splash`, `device_prefill`): the splash kernel, run by the Pallas
interpreter here, computes what the CPU path computes on the same block masks (grouped-query and
multi-head, lengths on and off the block grid, every width branch, step tables split across kernel
calls); full masks equal dense; sliding windows equal the windowed dense path; the batched selection and
its fallbacks are the host's per prompt; a whole model prefilled on device (sliding-window layers; a dense
first layer before MoE layers) equals the layer-by-layer host prefill; and the program compiles for TPU chips ahead of time and fits a v5e at 32k tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_flexprefill import LOCAL_SINK, structured_qk
from trainer_fixtures import tiny_spec

from upcycler.errors import UpcyclerError
from upcycler.train.config import ModelConfig
from upcycler.train.evaluation import long_eval as le
from upcycler.train.evaluation.config import PrefillConfig
from upcycler.train.evaluation.prefill import PrefillModel
from upcycler.train.model import flexprefill as fp
from upcycler.train.model import flexprefill_device as fd
from upcycler.train.model import flexprefill_splash as fs
from upcycler.train.model.params import init_params

BLOCK = 128
FP32 = {"rtol": 2e-5, "atol": 2e-5}
# the sparse kernel whenever the selection is under dense_above: at these lengths the cost model picks dense
SPARSE = PrefillConfig(prefill_min_budget=BLOCK, prefill_gamma=0.3, prefill_tau=0.0, prefill_dense_above=1.0,
                       prefill_kernel="sparse")
SMOLLM2 = Path(__file__).parents[1] / "bench" / "configs" / "models" / "smollm2-135m"


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def qkv(seed: int, batch: int, n: int, heads: int, kv_heads: int, head_dim: int = 32, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((batch, n, m, head_dim)) * scale, jnp.float32)
                 for m in (heads, kv_heads, kv_heads))


def block_masks(seed: int, batch: int, heads: int, nb: int, kind: str) -> np.ndarray:
    """[B, H, nb, nb] causal block masks with the diagonal: random, or the sink and diagonal only (sparse
    rows: a narrow width branch)."""
    rng = np.random.default_rng(seed)
    keep = rng.random((batch, heads, nb, nb)) < 0.4 if kind == "random" else np.zeros((batch, heads, nb, nb), bool)
    keep[..., 0] = True
    return (keep | np.eye(nb, dtype=bool)) & np.tril(np.ones((nb, nb), bool))


def host_sparse(q, k, v, mask_BHnn) -> np.ndarray:
    """The CPU path's attention over the same blocks, prompt by prompt."""
    nb = mask_BHnn.shape[-1]
    outs = []
    for b in range(q.shape[0]):
        ids, valid = fp.block_lists(jnp.asarray(mask_BHnn[b]), nb)
        outs.append(fp.sparse_attention(q[b], k[b], v[b], ids, valid, BLOCK))
    return np.stack(outs)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("n", [640, 600], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("kind", ["random", "sink_and_diagonal"])
def test_splash_equals_the_sparse_path_on_the_same_masks(heads, kv_heads, n, kind, monkeypatch):
    q, k, v = qkv(0, 2, n, heads, kv_heads)
    nb = fp.FlexPrefillOptions(block=BLOCK).blocks(n)
    mask = block_masks(1, 2, heads, nb, kind)
    densest = int(mask.sum(-1).max())
    width = next(w for w in fs.step_widths(nb) if w >= densest)
    assert (kind == "random") == (width == nb)  # the sparse masks run a narrower branch
    # step tables of at most two query blocks per call: several kernel calls per head group
    monkeypatch.setattr(fs, "SMEM_ENTRIES", 2 * (heads // kv_heads) * width)
    got = fs.block_sparse_attention(q, k, v, jnp.asarray(mask), BLOCK, interpret=True)
    np.testing.assert_allclose(got, host_sparse(q, k, v, mask), **FP32)


@pytest.mark.parametrize("n", [640, 600])
def test_full_masks_and_dense_equal_causal_attention(n):
    q, k, v = qkv(2, 2, n, 4, 2)
    nb = fp.FlexPrefillOptions(block=BLOCK).blocks(n)
    full = np.broadcast_to(np.tril(np.ones((nb, nb), bool)), (2, 4, nb, nb))
    want = np.stack([fp.causal_attention(q[b], k[b], v[b]) for b in range(2)])
    np.testing.assert_allclose(fs.block_sparse_attention(q, k, v, jnp.asarray(full), BLOCK, interpret=True), want,
                               **FP32)
    np.testing.assert_allclose(fs.dense_attention(q, k, v, interpret=True), want, **FP32)


def test_sliding_window_equals_the_windowed_dense_path():
    q, k, v = qkv(3, 2, 600, 4, 2)
    want = np.stack([fp.causal_attention(q[b], k[b], v[b], window=200) for b in range(2)])
    np.testing.assert_allclose(fs.dense_attention(q, k, v, window=200, interpret=True), want, **FP32)


def test_batched_selection_and_fallbacks_are_the_hosts_per_prompt():
    """Two prompts in one call: each gets the host's selection, density and query-aware heads; with
    `dense_above` between their densities, the denser one falls back to dense on its own."""
    pairs = [structured_qk(0, 1280, 4, 2, local=local, sink=sink) for local, sink in LOCAL_SINK.values()]
    q, k = (jnp.asarray(np.stack(x)) for x in zip(*pairs, strict=True))
    v = jnp.asarray(np.random.default_rng(4).standard_normal(k.shape), jnp.float32)
    opts = fp.FlexPrefillOptions(block=BLOCK, gamma=0.9, min_budget=BLOCK, tau=0.1, dense_above=1.0)
    densities = [fp.flexprefill_attention(q[b], k[b], v[b], opts).density_H.mean() for b in range(2)]
    assert densities[0] < densities[1] < 1
    opts = fp.FlexPrefillOptions(block=BLOCK, gamma=0.9, min_budget=BLOCK, tau=0.1,
                                 dense_above=float(np.mean(densities)), kernel="sparse")
    host = [fp.flexprefill_attention(q[b], k[b], v[b], opts) for b in range(2)]
    assert host[0].density_H.mean() < 1 and host[0].query_aware_H.any() and (host[1].density_H == 1).all()
    got = jax.jit(lambda *a: fd.flexprefill_attention(*a, opts, interpret=True))(q, k, v)
    for b, want in enumerate(host):
        np.testing.assert_allclose(got.out_BNHh[b], want.out_NHh, **FP32)
        np.testing.assert_allclose(got.density_BH[b], want.density_H, rtol=1e-6)
        np.testing.assert_array_equal(got.query_aware_BH[b], want.query_aware_H)
    every_prompt_dense = dataclasses.replace(opts, dense_above=0.0)  # the dense kernel's own tiles
    got = jax.jit(lambda *a: fd.flexprefill_attention(*a, every_prompt_dense, interpret=True))(q, k, v)
    for b in range(2):
        want = fp.flexprefill_attention(q[b], k[b], v[b], every_prompt_dense)
        np.testing.assert_allclose(got.out_BNHh[b], want.out_NHh, **FP32)
        assert (np.asarray(got.density_BH[b]) == 1).all() and (want.density_H == 1).all()


@pytest.fixture(scope="module")
def tiny_models():
    """A 3-layer model (a sliding-window layer, then two full ones), prefilled on the host and on device."""
    spec = tiny_spec(num_layers=3, layer_types=("sliding_attention", "full_attention", "full_attention"),
                     sliding_window=200, max_position_embeddings=4096)
    params = init_params(spec, jax.random.key(0))
    cfg = ModelConfig(compute_dtype="float32", attention="flexprefill")
    return (PrefillModel(spec, params, cfg, prefill=SPARSE, device=False),
            PrefillModel(spec, params, cfg, prefill=SPARSE, device=True, interpret=True))


def test_device_prefill_equals_the_host_prefill(tiny_models):
    host, device = tiny_models
    rng = np.random.default_rng(5)
    prompts, answers = rng.integers(0, host.spec.vocab_size, (2, 1100)), rng.integers(0, host.spec.vocab_size, (2, 3))
    got, want = device.run_batch(prompts, answers), host.run_batch(prompts, answers)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.last_logits, w.last_logits, **FP32)
        np.testing.assert_allclose(g.answer_logits, w.answer_logits, **FP32)
        np.testing.assert_allclose(g.stats.density, w.stats.density, rtol=1e-6)
        np.testing.assert_array_equal(g.stats.query_aware, w.stats.query_aware)
    assert (want[0].stats.density[0] == 1).all() and (want[0].stats.density[1:] < 1).all()  # window dense
    for (g, gs), (w, ws) in zip(device.next_token_logprobs_batch(prompts), host.next_token_logprobs_batch(prompts),
                                strict=True):
        np.testing.assert_allclose(g, w, **FP32)
        np.testing.assert_allclose(gs.density, ws.density, rtol=1e-6)


def test_device_prefill_halves_a_batch_the_chip_cannot_hold(tiny_models, monkeypatch):
    """A program that runs out of the chip's memory (XLA's RESOURCE_EXHAUSTED; simulated: a chip holding two
    prompts) is retried in halves, the results still the host's in order, and later batches of that shape
    start at the size that fit; a prompt that does not fit alone is one clear error."""
    host, device = tiny_models
    run_program, sizes = device._device_program, []
    monkeypatch.setattr(device, "_fitting_batch", {})  # the module's model keeps its own afterwards

    def chip_of_two(prompts, answers):
        sizes.append(len(prompts))
        if len(prompts) > 2:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
        return run_program(prompts, answers)

    monkeypatch.setattr(device, "_device_program", chip_of_two)
    rng = np.random.default_rng(5)
    prompts, answers = rng.integers(0, host.spec.vocab_size, (4, 1100)), rng.integers(0, host.spec.vocab_size, (4, 3))
    got, want = device.run_batch(prompts, answers), host.run_batch(prompts, answers)
    assert sizes == [4, 2, 2]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.last_logits, w.last_logits, **FP32)
        np.testing.assert_allclose(g.stats.density, w.stats.density, rtol=1e-6)
    device.run_batch(prompts[::-1], answers[::-1])
    assert sizes == [4, 2, 2, 2, 2]

    def no_room(prompts, answers):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")

    monkeypatch.setattr(device, "_device_program", no_room)
    with pytest.raises(UpcyclerError, match=r"a prompt of 1,100 tokens does not fit .* even alone; evaluate shorter"):
        device.run_batch(prompts[:3], answers[:3])


def test_device_prefill_equals_the_host_prefill_on_a_moe_with_a_dense_first_layer():
    """Two runs of layers (one dense, then MoE) scanned one after the other, equal to the host's layers."""
    spec = tiny_spec(moe=True, max_position_embeddings=4096)
    params = init_params(spec, jax.random.key(1))
    cfg = ModelConfig(compute_dtype="float32", attention="flexprefill")
    rng = np.random.default_rng(7)
    prompts, answers = rng.integers(0, spec.vocab_size, (2, 700)), rng.integers(0, spec.vocab_size, (2, 2))
    got = PrefillModel(spec, params, cfg, prefill=SPARSE, device=True, interpret=True).run_batch(prompts, answers)
    want = PrefillModel(spec, params, cfg, prefill=SPARSE, device=False).run_batch(prompts, answers)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.last_logits, w.last_logits, **FP32)
        np.testing.assert_allclose(g.answer_logits, w.answer_logits, **FP32)
        np.testing.assert_allclose(g.stats.density, w.stats.density, rtol=1e-6)
        assert (w.stats.density < 1).any()


class _BatchRecorder:
    """A runner of batch size 4 that records the shapes it is handed; its top-1 is each prompt's first id."""

    batch_size = 4

    def __init__(self):
        self.calls = []

    def run_batch(self, prompts, answers):
        from upcycler.train.evaluation.prefill import PrefillResult, PrefillStats

        self.calls.append((prompts.shape, answers.shape))
        stats = PrefillStats(np.ones((2, 4)), np.zeros((2, 4), bool), np.zeros(2, bool))
        return [PrefillResult(np.eye(64)[p[0]], np.eye(64)[a[:-1]], stats) for p, a in zip(prompts, answers)]


def test_evaluate_batches_prompts_of_one_shape():
    """`upcycle eval`'s scoring hands a runner batches of up to its batch size, each of one prompt and answer
    length, consecutive items in order, and scores each item from its own result."""
    shapes = [(300, 2), (300, 2), (300, 3), (300, 2), (300, 2), (300, 2), (300, 2), (300, 2), (280, 2)]
    items = [le.Item(n, np.full(n, i, np.int32), np.full(m, i, np.int32)) for i, (n, m) in enumerate(shapes)]
    runner = _BatchRecorder()
    records = le.evaluate(runner, "needle", items)
    assert runner.calls == [((2, 300), (2, 2)), ((1, 300), (1, 3)), ((4, 300), (4, 2)), ((1, 300), (1, 2)),
                            ((1, 280), (1, 2))]
    assert [r["top1"] for r in records] == list(range(len(items)))
    assert all(r["retrieved"] for r in records)  # answer i after prompt i: greedy would say i, i


def test_device_prefill_refuses_blocks_off_the_kernel_grid():
    spec = tiny_spec()
    with pytest.raises(UpcyclerError, match="multiple of 128"):
        PrefillModel(spec, init_params(spec, jax.random.key(0)),
                     ModelConfig(attention="flexprefill"), prefill=PrefillConfig(prefill_block=64), device=True)


def test_smollm2_prefill_compiles_for_tpu():
    """SmolLM2-135M's 30 layers prefilled with FlexPrefill at 32k tokens, compiled for one v5e chip, hold 4
    prompts; the grouped kernel and dense splash are both in the program. 128k and v6e compile too, in 1–3
    minutes each here: `bench/prefill_aot.py` gives every chip, length and batch."""
    from upcycler.io.hf_read import read_spec
    from upcycler.train.aot.prefill import compile_prefill

    cfg = ModelConfig(compute_dtype="float32", attention="flexprefill")
    compiled = compile_prefill(read_spec(SMOLLM2), cfg, chip="v5e", batch=4, length=32768)
    text = compiled.executable.as_text()
    assert "flexprefill_grouped" in text and "tpu_custom_call" in text  # the kernels are in the program
    assert compiled.fits, (compiled.peak_bytes, compiled.hbm_bytes)


@pytest.mark.parametrize("chip", ["v6e", "v5p"])
def test_the_grouped_kernel_compiles_for_other_chips(chip):
    """The grouped kernel alone (Mosaic's checks of its tiles, DMAs and scalar tables) at 32k tokens, GQA with
    G = 3 as SmolLM2, for the chips the model above is not compiled for here."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from upcycler.train.aot.topology import parse_slice, tpu_devices
    from upcycler.train.model import flexprefill_tpu as tpu

    devices = tpu_devices(parse_slice(f"{chip}-{8 if chip == 'v5p' else 4}"))
    mesh = Mesh(devices[:1], ("chip",))
    on_chip = NamedSharding(mesh, PartitionSpec())
    N, nb = 32768, 256
    shapes = [((1, N, 9, 64), jnp.bfloat16), ((1, N, 3, 64), jnp.bfloat16), ((1, N, 3, 64), jnp.bfloat16),
              ((1, 9, nb, nb), jnp.bool_)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=on_chip) for s, d in shapes]
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda q, k, v, m: tpu.block_sparse_attention(q, k, v, m, BLOCK)).lower(*args).compile()
    assert "flexprefill_grouped" in compiled.as_text()
