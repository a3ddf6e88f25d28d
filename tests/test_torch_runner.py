"""The torch runner on CPU with the tiny preset: paged chunked execution equals a plain forward, and the seams."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from servelab.common.errors import InputError, ServelabError
from servelab.runners.base import StepItem, StepPlan, StepShape
from servelab.runners.paged_kv import BlockAllocator, build_layout, synthetic_token_ids

REPO = Path(__file__).resolve().parents[1]


# ---- helpers -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def make_runner(torch, **kw):
    from servelab.runners.torch_runner import TorchRunner

    kw.setdefault("model_name", "tiny")
    kw.setdefault("device", "cpu")
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("threads", 1)  # tiny tensors: one thread is fastest and immune to a busy machine
    return TorchRunner(**kw)


def fake_request(request_id: int, prompt_tokens: int):
    return SimpleNamespace(request_id=request_id, prompt_tokens=prompt_tokens, block_table=[])


def plan_of(*items: tuple) -> StepPlan:
    return StepPlan(StepShape(), tuple(StepItem(req, start, n) for req, start, n in items))


def grow(alloc: BlockAllocator, req, tokens: int, block_size: int) -> None:
    need = -(-tokens // block_size) - len(req.block_table)
    req.block_table.extend(alloc.allocate(max(0, need)))


def dense_logits(runner, req, length: int):
    import torch

    ids = synthetic_token_ids(np.full(length, req.request_id), np.arange(length), runner.args.vocab_size)
    return runner.model.forward_dense(torch.from_numpy(ids))


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, block_table=None):
    """FlashAttention varlen semantics on CPU (test only): causal aligned to each sequence's key end."""
    import torch
    import torch.nn.functional as F

    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[-2]
    for b in range(cu_q.shape[0] - 1):
        q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
        k0, k1 = int(cu_k[b]), int(cu_k[b + 1])
        klen = k1 - k0
        if block_table is not None:
            keys, values = k[block_table[b].long()].flatten(0, 1)[:klen], v[block_table[b].long()].flatten(0, 1)[:klen]
        else:
            keys, values = k[k0:k1], v[k0:k1]
        qlen = q1 - q0
        allowed = torch.arange(klen)[None, :] <= torch.arange(qlen)[:, None] + (klen - qlen)
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                           attn_mask=allowed)
        out[q0:q1] = o.transpose(0, 1)
    # FlashAttention takes max_q / max_k as upper bounds (graphed steps pass their bucket's width)
    assert max_q >= int((cu_q[1:] - cu_q[:-1]).max()) and max_k >= int((cu_k[1:] - cu_k[:-1]).max())
    return out


# ---- block allocator (no torch needed) -----------------------------------------------------------


def test_allocator_hands_out_lowest_ids_first_and_reuses_freed_ones():
    alloc = BlockAllocator(8)
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(2) == [3, 4]
    alloc.free([1, 3])
    assert (alloc.num_free, alloc.num_used) == (5, 3)
    assert alloc.allocate(3) == [1, 3, 5]
    assert alloc.can_allocate(2) and not alloc.can_allocate(3)


def test_allocator_refuses_overallocation_with_counts_in_message():
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    with pytest.raises(ServelabError, match="asked for 2 blocks, only 1 of 4 free"):
        alloc.allocate(2)
    assert alloc.num_free == 1  # a refused request takes nothing


@pytest.mark.parametrize("bad", [[0, 0], [9], [-1]])
def test_allocator_rejects_double_free_and_foreign_ids(bad):
    alloc = BlockAllocator(4)
    alloc.allocate(1)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(bad)


def test_allocator_with_an_offset_owns_only_its_range():
    alloc = BlockAllocator(3, first_id=10)
    assert alloc.allocate(2) == [10, 11]
    with pytest.raises(ValueError, match="block 2 is not allocated"):
        alloc.free([2])
    alloc.free([11])
    assert alloc.allocate(2) == [11, 12]


def test_allocator_needs_a_block():
    with pytest.raises(ServelabError, match="num_blocks >= 1"):
        BlockAllocator(0)


def test_layout_maps_positions_to_engine_block_slots():
    layout = build_layout([5, 6], [3, 10], [2, 0], [2, 3], [[7, 2], [4, 1, 6]], block_size=2, num_blocks=8,
                          vocab_size=100, kind="paged")
    # request 5: positions 2, 3 live in its second block (id 2); request 6: positions 0, 1 in block 4, 2 in block 1
    assert layout.positions.tolist() == [2, 3, 0, 1, 2]
    assert layout.slots.tolist() == [4, 5, 8, 9, 2]
    assert layout.block_table.tolist() == [[7, 2], [4, 1]]  # only the blocks the step can touch
    assert layout.cu_q.tolist() == [0, 2, 5] and layout.ctx_lens.tolist() == [4, 3]
    assert layout.cu_k.tolist() == [0, 4, 7] and layout.total_k == 7 and layout.max_k == 4
    assert layout.sample_rows.tolist() == [1]  # only request 5 reaches its known tokens


def test_layout_refuses_a_short_block_table():
    with pytest.raises(ServelabError, match="request 6: block_table has 1 blocks, needs 2 for 3 tokens"):
        build_layout([6], [3], [0], [3], [[4]], block_size=2, num_blocks=8, vocab_size=100, kind="sdpa")


def test_layout_refuses_block_ids_outside_the_pool():
    with pytest.raises(ServelabError, match=r"outside \[0, 8\)"):
        build_layout([6], [3], [0], [3], [[4, 8]], block_size=2, num_blocks=8, vocab_size=100, kind="sdpa")


def test_importing_the_runner_seams_does_not_import_torch():
    code = ("import sys, servelab, servelab.runners.base, servelab.runners.paged_kv, servelab.runners.torch_runner;"
            "from servelab.runners.base import RUNNERS; assert 'torch' in RUNNERS.names(), RUNNERS.names();"
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_torch_runner_without_torch_is_a_clear_error():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from servelab.common.errors import ServelabError\n"
            "from servelab.runners.base import make_runner\n"
            "try:\n    make_runner('torch:model=tiny,device=cpu')\nexcept ServelabError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, text=True).stdout
    assert "runner 'torch' needs PyTorch: pip install 'servelab[torch]'" in out


# ---- correctness: paged, chunked, mixed == plain full forward ------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "paged", "gather"])
def test_chunked_mixed_batches_match_full_sequence_forward(torch, attention):
    # paged / gather: the GPU paths' index plumbing, run through a CPU reference of FlashAttention varlen
    kernel = None if attention == "sdpa" else varlen_reference
    bs = 256 if attention == "paged" else 4
    runner = make_runner(torch, block_size=bs, num_blocks=64, attention=attention, warmup=False, varlen_kernel=kernel)
    alloc = BlockAllocator(64)
    alloc.allocate(5)  # so tables do not start at block 0
    a, b, c = fake_request(11, 23), fake_request(12, 9), fake_request(13, 5)
    steps = [
        [(a, 0, 8), (b, 0, 9), (c, 0, 5)],  # chunk, whole prompt, whole prompt
        [(b, 9, 1), (a, 8, 7), (c, 5, 1)],  # decodes mixed with a middle chunk
        [(a, 15, 8), (b, 10, 1)],  # last chunk completes a's prompt
        [(a, 23, 1), (c, 6, 1), (b, 11, 1)],
        [(a, 24, 1)],
    ]
    got: dict[int, list] = {11: [], 12: [], 13: []}
    for step in steps:
        for req, start, n in step:
            grow(alloc, req, start + n, bs)
        if attention != "paged":
            alloc.allocate(1)  # interleave foreign blocks so tables are scattered
        logits = runner.execute(plan_of(*step), all_logits=True)
        row = 0
        for req, _start, n in step:
            got[req.request_id].append(logits[row:row + n])
            row += n
    for req, length in ((a, 25), (b, 12), (c, 7)):
        paged = torch.cat(got[req.request_id])
        ref = dense_logits(runner, req, length)
        assert paged.shape == ref.shape
        torch.testing.assert_close(paged, ref, atol=1e-4, rtol=1e-4)


def test_varlen_probe_accepts_a_correct_kernel_and_catches_top_left_causal(torch, monkeypatch):
    from servelab.runners import torch_model

    args = torch_model.ModelArgs.from_name("tiny")
    monkeypatch.setattr(torch_model, "varlen_api", lambda: "paged")
    monkeypatch.setattr(torch_model, "varlen_attention", varlen_reference)
    assert torch_model.probe_varlen(args, torch.float32, "cpu") == {"packed": None, "paged": None}

    def top_left(q, k, v, cu_q, cu_k, max_q, max_k, block_table=None):  # causal from the first key: wrong here
        shifted = cu_k.clone()
        out = torch.empty_like(q)
        for b in range(cu_q.shape[0] - 1):
            n = int(cu_q[b + 1] - cu_q[b])
            shifted = torch.tensor([0, n], dtype=cu_k.dtype)
            keys = k[int(cu_k[b]):int(cu_k[b]) + n] if block_table is None else k[block_table[b].long()].flatten(0, 1)[:n]
            vals = v[int(cu_k[b]):int(cu_k[b]) + n] if block_table is None else v[block_table[b].long()].flatten(0, 1)[:n]
            out[int(cu_q[b]):int(cu_q[b + 1])] = varlen_reference(q[int(cu_q[b]):int(cu_q[b + 1])], keys, vals,
                                                                  torch.tensor([0, n]), shifted, n, n)
        return out

    monkeypatch.setattr(torch_model, "varlen_attention", top_left)
    probe = torch_model.probe_varlen(args, torch.float32, "cpu")
    assert "differs from the reference" in probe["packed"] and "differs" in probe["paged"]


def test_varlen_probe_reports_failures_instead_of_raising(torch, monkeypatch):
    from servelab.runners import torch_model

    def broken(*_args, **_kw):
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(torch_model, "varlen_api", lambda: "packed")
    monkeypatch.setattr(torch_model, "varlen_attention", broken)
    probe = torch_model.probe_varlen(torch_model.ModelArgs.from_name("tiny"), torch.float32, "cpu")
    assert probe == {"packed": "RuntimeError: no kernel image", "paged": "varlen_attn takes no block tables"}


def test_varlen_call_passes_block_tables_only_where_the_op_takes_them(torch, monkeypatch):
    from servelab.runners import torch_model

    calls = []

    def op(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, **kw):
        calls.append({"causal": is_causal, "dropout": dropout_p, **{n: t.tolist() for n, t in kw.items()}})
        return q, None, None, None, None

    q = torch.zeros(3, 4, 8)
    cu_q, cu_k = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32)
    table = torch.tensor([[3], [1]], dtype=torch.int32)
    monkeypatch.setattr(torch_model, "_flash_op", lambda: op)
    old = frozenset({"query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal"})
    monkeypatch.setattr(torch_model, "_flash_args", lambda: old)
    assert torch_model.varlen_api() == "packed"
    assert torch_model.varlen_attention(q, q, q, cu_q, cu_k, 2, 5) is q
    with pytest.raises(ServelabError, match="needs FlashAttention with block tables"):
        torch_model.varlen_attention(q, q, q, cu_q, cu_k, 2, 5, table)
    monkeypatch.setattr(torch_model, "_flash_args", lambda: old | {"seqused_k", "block_table"})
    assert torch_model.varlen_api() == "paged"
    torch_model.varlen_attention(q, q, q, cu_q, cu_k, 2, 5, table)
    assert calls == [{"causal": True, "dropout": 0.0},
                     {"causal": True, "dropout": 0.0, "seqused_k": [5, 4], "block_table": [[3], [1]]}]


def test_this_torch_has_a_flash_varlen_op_with_block_tables(torch):
    from servelab.runners import torch_model

    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12):
        pytest.skip("older torch")
    assert torch_model.varlen_api() == "paged"


def test_recompute_after_preemption_into_other_blocks_reproduces_logits(torch):
    runner = make_runner(torch, warmup=False)
    alloc = BlockAllocator(64)
    a = fake_request(3, 10)
    grow(alloc, a, 10, 4)
    first = runner.execute(plan_of((a, 0, 6)), all_logits=True)
    runner.execute(plan_of((a, 6, 4)), all_logits=True)
    alloc.free(a.block_table)  # preempted: KV dropped
    a.block_table = list(reversed(alloc.allocate(6)[3:]))  # other, descending ids
    again = runner.execute(plan_of((a, 0, 10)), all_logits=True)
    torch.testing.assert_close(again[:6], first, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, dense_logits(runner, a, 10), atol=1e-4, rtol=1e-4)


def test_sampled_logits_are_the_last_row_of_items_that_emit_a_token(torch):
    runner = make_runner(torch, warmup=False)
    alloc = BlockAllocator(64)
    a, b = fake_request(1, 12), fake_request(2, 3)
    grow(alloc, a, 5, 4)
    grow(alloc, b, 3, 4)
    plan = plan_of((a, 0, 5), (b, 0, 3))  # a is mid-prompt: no token; b completes its prompt
    sampled = runner.execute(plan)
    assert sampled.shape[0] == 1
    torch.testing.assert_close(sampled[0], dense_logits(runner, b, 3)[-1], atol=1e-4, rtol=1e-4)


# ---- runner protocol, timing, determinism --------------------------------------------------------


def test_step_time_measures_a_positive_time_and_records_stats(torch):
    runner = make_runner(torch)
    alloc = BlockAllocator(64)
    a, b = fake_request(1, 6), fake_request(2, 4)
    grow(alloc, a, 7, 4)
    grow(alloc, b, 4, 4)
    t = runner.step_time(plan_of((a, 0, 6), (b, 0, 4)))
    assert t > 0 and runner.last_stats.device_s == t
    assert runner.last_stats.tokens == 10 and runner.last_stats.seqs == 2
    assert runner.last_stats.prepare_s > 0 and runner.last_stats.wall_s >= t
    assert runner.last_tokens.shape == (2,)
    runner.step_time(plan_of((a, 6, 1)))
    assert runner.stats.steps == 2 and runner.stats.tokens == 11  # warm-up is not counted
    assert runner.step_time(StepPlan(StepShape())) == 0.0


def test_same_seed_same_samples_other_seed_other_weights(torch):
    def run(seed):
        runner = make_runner(torch, seed=seed, warmup=False)
        alloc = BlockAllocator(64)
        reqs = [fake_request(i, 5 + i) for i in range(4)]
        for r in reqs:
            grow(alloc, r, r.prompt_tokens, 4)
        runner.step_time(plan_of(*((r, 0, r.prompt_tokens) for r in reqs)))
        return runner.last_tokens, runner.model.embed.weight.clone()

    t1, w1 = run(0)
    t2, w2 = run(0)
    _, w3 = run(1)
    assert np.array_equal(t1, t2) and torch.equal(w1, w2) and not torch.equal(w1, w3)


def test_protocol_fields_and_kv_sizing(torch):
    from servelab.runners.base import Runner

    runner = make_runner(torch, num_blocks=40, block_size=8)
    assert isinstance(runner, Runner)
    assert runner.name == "torch" and runner.needs_block_tables is True
    assert runner.decode_affine(8) is None
    # tiny: 2 layers x (K and V) x 2 KV heads x head_dim 16 x float32
    assert runner.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert runner.kv_capacity_tokens(0.5) == 40 * 8 and runner.total_blocks == 40
    d = runner.describe()
    assert d["runner"] == "torch" and d["num_blocks"] == 40 and d["attention"] == "sdpa"
    assert d["model"]["name"] == "tiny" and d["dtype"] == "float32"
    json.dumps(d)
    with pytest.raises(ServelabError, match="gpu_memory_utilization"):
        runner.kv_capacity_tokens(1.5)


def test_make_allocator_gives_replicas_disjoint_ranges_of_the_pool(torch):
    runner = make_runner(torch, num_blocks=10)
    first, second = runner.make_allocator(0, 5), runner.make_allocator(1, 5)
    assert first.allocate(5) == [0, 1, 2, 3, 4] and second.allocate(1) == [5]
    with pytest.raises(ServelabError, match="pool has 10 blocks of 4 tokens"):
        runner.make_allocator(2, 5)


def test_cpu_pool_is_sized_on_first_use_when_not_given(torch):
    runner = make_runner(torch, num_blocks=None, block_size=16)
    assert runner.kv_capacity_tokens() == 65536 and runner.num_blocks == 4096


# ---- registry / factory --------------------------------------------------------------------------


def test_make_runner_builds_torch_from_a_spec(torch):
    from servelab.runners.base import make_runner as build

    runner = build("torch:model=tiny,device=cpu,num_blocks=16,seed=3,block_size=4,threads=1", model="llama-3.1-8b")
    assert runner.args.name == "tiny" and runner.seed == 3 and runner.total_blocks == 16


def test_factory_takes_model_and_block_size_from_context(torch):
    from servelab.runners.base import make_runner as build

    runner = build("torch:device=cpu,num_blocks=8,threads=1", model="tiny", block_size=32)
    assert runner.args.name == "tiny" and runner.block_size == 32


@pytest.mark.parametrize(
    "spec, message",
    [
        ("torch:model=tiny,device=cpu,colour=red", "unknown parameter 'colour'"),
        ("torch:model=tiny,device=cpu,num_blocks=many", "num_blocks: expected a finite int, got 'many'"),
        ("torch:model=tiny,device=cpu,dtype=int8", "dtype must be one of"),
        ("torch:model=tiny,device=tpu", "device must be cpu or cuda"),
        ("torch:model=tiny,device=cpu,attention=magic", "attention must be auto or one of"),
        ("torch:model=tiny,device=cpu,attention=paged,block_size=16", "multiple of 256"),
        ("torch:model=tiny,device=cpu,attention=gather", "attention=gather is unavailable on cpu"),
        ("torch:model=nope,device=cpu", "unknown model preset 'nope'"),
        ("torch:model=tiny,device=cpu,num_blocks=0", "num_blocks must be >= 1"),
        ("torch:model=tiny,device=cpu,warmup=maybe", "warmup: expected bool, got 'maybe'"),
        ("torch:model=tiny,device=cpu,threads=0", "threads must be >= 1"),
        ("torch:model=hf,device=cpu", "model=hf needs weights="),
    ],
)
def test_factory_rejects_bad_parameters(torch, spec, message):
    from servelab.runners.base import make_runner as build

    with pytest.raises(ServelabError, match=message):
        build(spec)


def test_cuda_request_without_cuda_is_a_clear_error(torch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from servelab.runners.base import make_runner as build

    with pytest.raises(ServelabError, match="CUDA is not available"):
        build("torch:model=tiny,device=cuda")


# ---- local safetensors weights (Hugging Face names) ----------------------------------------------

TINY_HF_CONFIG = {
    "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}


def save_weights(torch, runner, folder: Path, drop: str | None = None, reshape: str | None = None) -> Path:
    from safetensors.torch import save_file

    state = {k: v.clone() for k, v in runner.model.hf_state().items() if k != drop}
    if reshape:
        state[reshape] = state[reshape][:-1].clone()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    return folder


def test_loads_hf_safetensors_and_config(torch, tmp_path):
    pytest.importorskip("safetensors")
    source = make_runner(torch, seed=5, warmup=False)
    folder = save_weights(torch, source, tmp_path / "tiny-hf")
    loaded = make_runner(torch, model_name="hf", weights=str(folder), seed=99, warmup=False)
    assert loaded.args.num_layers == 2 and loaded.args.name == "tiny-hf"
    ids = torch.arange(9) % 512
    torch.testing.assert_close(loaded.model.forward_dense(ids), source.model.forward_dense(ids), atol=0, rtol=0)
    # a single file and an explicit preset work too
    single = make_runner(torch, model_name="tiny", weights=str(folder / "model.safetensors"), warmup=False)
    assert torch.equal(single.model.layers[1].w13.weight, source.model.layers[1].w13.weight)


def test_missing_tensor_names_file_and_tensor(torch, tmp_path):
    pytest.importorskip("safetensors")
    source = make_runner(torch, warmup=False)
    folder = save_weights(torch, source, tmp_path / "w", drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(InputError, match=r"model\.safetensors, column 'model\.layers\.1\.mlp\.up_proj\.weight': missing 1"):
        make_runner(torch, model_name="tiny", weights=str(folder), warmup=False)


def test_wrong_shape_names_tensor_and_shapes(torch, tmp_path):
    pytest.importorskip("safetensors")
    source = make_runner(torch, warmup=False)
    folder = save_weights(torch, source, tmp_path / "w", reshape="model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(InputError, match=r"column 'model\.layers\.0\.self_attn\.k_proj\.weight': shape \(31, 64\)"):
        make_runner(torch, model_name="tiny", weights=str(folder), warmup=False)


def test_weights_without_config_need_a_preset(torch, tmp_path):
    pytest.importorskip("safetensors")
    source = make_runner(torch, warmup=False)
    folder = save_weights(torch, source, tmp_path / "w")
    (folder / "config.json").unlink()
    with pytest.raises(ServelabError, match="no config.json"):
        make_runner(torch, model_name="hf", weights=str(folder), warmup=False)


def test_llama31_preset_shape_and_rope_scaling(torch):
    from servelab.runners.torch_model import ModelArgs, rope_inv_freq

    a = ModelArgs.from_name("llama-3.1-8b")
    assert (a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.ffn_size, a.vocab_size) == (
        32, 4096, 32, 8, 128, 14336, 128256)
    assert a.rope_theta == 500000.0 and a.rope_scaling is not None
    assert 8.0e9 < a.num_params < 8.1e9  # 8.03B
    inv = rope_inv_freq(a)
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    assert torch.isclose(inv[0], base[0].float()) and torch.isclose(inv[-1], (base[-1] / 8).float())


# ---- bench/gpu_check.py on CPU (the same script the H200 runs) ----------------------------------


def load_gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_smoke_runs_every_phase_on_cpu(torch, tmp_path):
    import pyarrow as pa

    from servelab.traces.io import write_trace

    n = 16
    trace = write_trace(pa.table({"request_id": list(range(n)), "arrival_s": [0.05 * i for i in range(n)],
                                  "prompt_tokens": [20 + 7 * i for i in range(n)],
                                  "output_tokens": [3 + i % 5 for i in range(n)]}), tmp_path / "t.parquet", "test")
    out = tmp_path / "out"
    code = load_gpu_check().main(["--model", "tiny", "--device", "cpu", "--quick", "--threads", "1",
                                  "--out", str(out), "--trace", str(trace)])
    result = json.loads((out / "gpu_check.json").read_text())
    phases = result["phases"]
    assert code == 0, {k: v.get("error") for k, v in phases.items()}
    assert set(phases) == {"env", "correctness", "decode", "prefill", "profile", "fit", "validate"}
    assert all(p["status"] == "ok" for p in phases.values())
    assert phases["correctness"]["pass"] is True
    assert phases["decode"]["pass"] is None  # no bandwidth verdict on a CPU
    assert all(r["step_ms"] > 0 for r in phases["decode"]["rows"])
    assert phases["validate"]["requests"] == 12  # --quick keeps the first 12
    assert "fitted step MAPE" in phases["validate"]["summary"] and "roofline step MAPE" in phases["validate"]["summary"]
    for name in ("profile.parquet", "fitted.json", "validate_fitted.json", "validate_roofline.json"):
        assert (out / name).is_file()


def test_gpu_check_records_a_failed_phase_and_skips_over_budget(tmp_path):
    gc = load_gpu_check()
    check = gc.Check(tmp_path, budget_s=100.0)
    check.phase("boom", lambda: 1 / 0)
    check.phase("fine", lambda: {"summary": "x"})
    check.phase("late", lambda: {}, min_s=1e9)
    phases = json.loads((tmp_path / "gpu_check.json").read_text())["phases"]
    assert phases["boom"]["status"] == "error" and "ZeroDivisionError" in phases["boom"]["error"]
    assert phases["fine"]["status"] == "ok"
    assert phases["late"]["status"] == "skipped" and "budget" in phases["late"]["reason"]


def test_gpu_check_reads_the_azure_csv_without_polars(monkeypatch):
    shared = REPO.parent / "shared" / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    if not shared.is_file():
        pytest.skip("shared traces not present")
    from servelab.traces.importers import import_trace

    gc = load_gpu_check()
    expected = import_trace("azure", [shared]).table
    monkeypatch.setitem(sys.modules, "servelab.traces.importers", None)  # as on the GPU image: no polars
    table = gc.load_trace(shared)
    assert table.num_rows == expected.num_rows == 19366
    for name in ("arrival_s", "prompt_tokens", "output_tokens"):
        assert table.column(name).to_pylist() == expected.column(name).to_pylist()


# ---- graphed decode steps (on CPU: the same padded static layout, without capture) ---------------


@pytest.mark.parametrize("attention", ["sdpa", "paged"])
def test_graphed_decode_steps_match_the_full_forward(torch, attention):
    kernel = varlen_reference if attention == "paged" else None
    bs = 256 if attention == "paged" else 4
    runner = make_runner(torch, block_size=bs, num_blocks=32, attention=attention, varlen_kernel=kernel,
                         cuda_graphs=True, warmup=False)
    alloc = runner.make_allocator(0, runner.total_blocks)
    reqs = [fake_request(40 + i, 5 + 3 * i) for i in range(3)]
    for r in reqs:
        grow(alloc, r, r.prompt_tokens, bs)
    runner.step_time(plan_of(*((r, 0, r.prompt_tokens) for r in reqs)))  # prefill: eager
    assert runner._graphs.entries == {}
    decoded: dict[int, list] = {r.request_id: [] for r in reqs}
    for step in range(3):
        for r in reqs:
            grow(alloc, r, r.prompt_tokens + step + 1, bs)
        runner.step_time(plan_of(*((r, r.prompt_tokens + step, 1) for r in reqs)))
        logits = runner._graphs.last_entry["outputs"][0]
        assert logits.shape[0] == 4  # 3 requests padded to the bucket of 4
        for i, r in enumerate(reqs):
            decoded[r.request_id].append(logits[i])
        assert runner.last_tokens.tolist() == logits[:3].argmax(-1).tolist()
    for r in reqs:
        ref = dense_logits(runner, r, r.prompt_tokens + 3)[r.prompt_tokens:]
        torch.testing.assert_close(torch.stack(decoded[r.request_id]), ref, atol=1e-4, rtol=1e-4)
    # one graph: batch bucket 4, table width bucket = blocks of the longest context (14 tokens) rounded to 2^k
    assert runner.describe()["cuda_graphs"]["graphs"] == [(4, 1 if bs == 256 else 4)]
    assert runner.scratch_block == 32 and runner.total_blocks == 32  # the scratch block is not the engine's


def test_graphs_leave_prefills_and_oversized_batches_to_the_eager_path(torch):
    runner = make_runner(torch, num_blocks=64, cuda_graphs=True, graph_max_batch=2, warmup=False)
    alloc = runner.make_allocator(0, runner.total_blocks)
    reqs = [fake_request(i, 3) for i in range(3)]
    for r in reqs:
        grow(alloc, r, 4, 4)
    assert runner._graphs.prepare(plan_of((reqs[0], 0, 3))) is None  # a chunk, not a decode
    assert runner._graphs.prepare(plan_of(*((r, 3, 1) for r in reqs))) is None  # 3 > graph_max_batch
    assert runner._graphs.prepare(plan_of(*((r, 3, 1) for r in reqs[:2]))) is not None


# ---- shared cached blocks: requests whose prompts share hashed blocks share their KV ---------------


def hashed_request(request_id: int, prompt_tokens: int, hashes: list[int]):
    return SimpleNamespace(request_id=request_id, prompt_tokens=prompt_tokens, block_table=[], prefix_hashes=hashes)


def dense_hashed_logits(runner, req, length: int, hash_block: int):
    """A plain forward of ``req``'s first ``length`` tokens, its ids built here: prompt tokens covered
    by hash block i derive from hash i (XOR the runner's constant), the rest from the request id."""
    import torch

    from servelab.runners.paged_kv import HASHED_SEED

    pos = np.arange(length)
    seeds = np.full(length, req.request_id, dtype=np.uint64)
    for p in range(min(length, req.prompt_tokens, len(req.prefix_hashes) * hash_block)):
        seeds[p] = np.uint64(req.prefix_hashes[p // hash_block]) ^ HASHED_SEED
    ids = synthetic_token_ids(seeds, pos, runner.args.vocab_size)
    return runner.model.forward_dense(torch.from_numpy(ids))


@pytest.mark.parametrize("attention", ["sdpa", "gather"])
def test_a_batch_whose_requests_share_cached_blocks_matches_dense_forwards(torch, attention):
    """A computes its 20-token prompt (hash blocks of 8 tokens = 2 engine blocks of 4). B and D share A's
    first hash block: their block tables start with A's 2 blocks, and one batch computes only the rest
    of each (a prefix cache hit), beside A's decode and E's unrelated prompt. Every logit row equals a
    dense forward of the request's whole sequence."""
    kernel = None if attention == "sdpa" else varlen_reference
    runner = make_runner(torch, block_size=4, num_blocks=64, attention=attention, warmup=False,
                         varlen_kernel=kernel, hash_block_tokens=8)
    alloc = BlockAllocator(64)
    alloc.allocate(3)
    a = hashed_request(21, 20, [101, 102])
    b = hashed_request(22, 18, [101, 203])  # shares A's first hash block
    d = hashed_request(24, 11, [101])  # shares it too; its last 3 prompt tokens are its own
    e = hashed_request(25, 6, [])
    grow(alloc, a, 20, 4)
    first = runner.execute(plan_of((a, 0, 20)), all_logits=True)
    torch.testing.assert_close(first, dense_hashed_logits(runner, a, 20, 8), atol=1e-4, rtol=1e-4)
    for req in (b, d):
        req.block_table = list(a.block_table[:2])  # the cached prefix: A's blocks, not copies
    grow(alloc, a, 21, 4)
    for req, tokens in ((b, 18), (d, 11), (e, 6)):
        grow(alloc, req, tokens, 4)
    logits = runner.execute(plan_of((a, 20, 1), (b, 8, 10), (d, 8, 3), (e, 0, 6)), all_logits=True)
    rows = {21: logits[0:1], 22: logits[1:11], 24: logits[11:14], 25: logits[14:20]}
    torch.testing.assert_close(rows[21], dense_hashed_logits(runner, a, 21, 8)[20:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rows[22], dense_hashed_logits(runner, b, 18, 8)[8:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rows[24], dense_hashed_logits(runner, d, 11, 8)[8:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rows[25], dense_hashed_logits(runner, e, 6, 8), atol=1e-4, rtol=1e-4)
    # and a request that only looks like A (other hashes) computes other logits
    assert not torch.allclose(dense_hashed_logits(runner, hashed_request(21, 20, [901, 902]), 20, 8), first)


def test_requests_without_hashes_keep_their_request_id_tokens(torch):
    runner = make_runner(torch, warmup=False, hash_block_tokens=8)
    alloc = BlockAllocator(64)
    a = fake_request(3, 10)
    grow(alloc, a, 10, 4)
    torch.testing.assert_close(runner.execute(plan_of((a, 0, 10)), all_logits=True), dense_logits(runner, a, 10),
                               atol=1e-4, rtol=1e-4)


# ---- a replay on shared cached blocks: the engine names the prefix cache's blocks -----------------


class Recorder:
    """Wraps the torch runner: each step runs for real (all logits kept) and is priced by a fixed
    line, so the replay is deterministic; records every item with a copy of its block table."""

    needs_block_tables = True

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.steps: list = []

    def step_time(self, plan):
        logits = self.inner.execute(plan, all_logits=True)
        rows = 0
        items = []
        for it in plan.items:
            items.append((it.request, it.start, it.num_tokens, list(it.request.block_table),
                          logits[rows:rows + it.num_tokens]))
            rows += it.num_tokens
        self.steps.append(items)
        return 0.01 + 1e-4 * rows

    def decode_affine(self, num_seqs):
        return None

    def make_allocator(self, replica, num_blocks):
        return self.inner.make_allocator(replica, num_blocks)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_replay_with_prefix_caching_shares_real_blocks_and_matches_dense_forwards(torch, monkeypatch):
    """Sessions of two tenants (a 32-token system prompt each, turns carrying their context) replayed
    on the torch runner with prefix caching, in a pool small enough to evict: (a) requests that hold
    the same block id at once hold it at the same position with the same hashed prefix, and some do;
    (b) every logit row of every step equals a dense forward of the request's whole sequence;
    (c) the KV manager's checks (ids too) hold after every step; (d) ids are reused after eviction
    (a block id later holds other content) without breaking (b)."""
    import servelab.assembly
    from servelab.api import EngineConfig, ReplayConfig, replay
    from servelab.replay.core.engine import Engine
    from servelab.traces.synth import synth_trace

    class Checked(Engine):
        checks = 0

        def _complete(self, replica, now):
            super()._complete(replica, now)
            for rep in self.replicas:
                rep.kv.check(rep.running)
                assert rep.kv.cache.names is not None
            Checked.checks += 1

    monkeypatch.setattr(servelab.assembly, "Engine", Checked)
    hb = 16
    trace = synth_trace(n=30, rate=20.0, prompt="lognormal:24:0.5", output="lognormal:4:0.5", tenants="a=1,b=1",
                        shared_prefix_tokens=32, turns=3.0, think_s=0.05, prefix_block_tokens=hb, seed=5)
    inner = make_runner(torch, block_size=4, num_blocks=64, warmup=False)
    runner = Recorder(inner)
    inner.hash_block_tokens = hb
    cfg = ReplayConfig(engine=EngineConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=64,
                                           enable_prefix_caching=True),
                       policy="sarathi", runner="torch")
    result = replay(trace, cfg, runner=runner)
    assert Checked.checks > 20
    assert set(result.requests.column("status").to_pylist()) == {"finished"}
    assert sum(result.requests.column("cached_tokens").to_pylist()) > 100  # prefixes were really reused

    def content(req, block):  # what block ``block`` of req holds: its hashed prefix, else its own tokens
        last = (block + 1) * 4 - 1
        covered = min(req.prompt_tokens, len(req.prefix_hashes or ()) * hb)
        return tuple(req.prefix_hashes[:last // hb + 1]) if last < covered else (req.request_id, block)

    dense: dict[int, object] = {}
    shared = 0
    holds: dict[int, tuple] = {}  # block id -> content, as last seen
    reused = 0
    for items in runner.steps:
        where: dict[int, tuple] = {}
        for req, start, n, table, logits in items:
            full = dense.get(req.request_id)
            if full is None:
                full = dense[req.request_id] = dense_hashed_logits(inner, req, req.prompt_tokens + req.output_tokens, hb)
            torch.testing.assert_close(logits, full[start:start + n], atol=1e-4, rtol=1e-4)  # (b)
            for block, bid in enumerate(table[:-(-(start + n) // 4)]):
                what = content(req, block)
                other = where.get(bid)
                if other is not None:  # (a) one id in two tables at once: the same block of the same prefix
                    assert other[1] == block and other[2] == what, (bid, other, block, what)
                    shared += 1
                where[bid] = (req.request_id, block, what)
                if block * 4 < start and holds.get(bid) not in (None, what):  # read, not written, yet held else
                    raise AssertionError(f"block {bid} read as {what} but last held {holds[bid]}")
                if holds.get(bid) not in (None, what):
                    reused += 1
                holds[bid] = what
    assert shared > 0 and reused > 0
    assert sum(result.requests.column("num_preemptions").to_pylist()) > 0  # own segments were named too
