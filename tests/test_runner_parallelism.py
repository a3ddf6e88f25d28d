"""Parallelism beyond one NVLink TP group: links (PCIe vs NVLink), data-parallel attention with
expert-parallel MoE, pipeline parallelism, and how a replay maps them onto engines and GPUs.

Physics floors: no collective is faster than the bytes each GPU must move over its link at the
link's nominal bandwidth. Expected values are written out from docs/runners.md "Parallelism".
"""

import dataclasses
import json

import pytest
from servelab.common.errors import ServelabError
from servelab.runners.all_reduce import LINKS, all_reduce_time_s, send_time_s
from servelab.runners.base import StepPlan, StepShape, make_runner
from servelab.runners.presets import GPUS, get_gpu

KIB, MIB = 1024, 1024 * 1024
SIZES = [16 * 4**i for i in range(12)] + [64 * MIB]  # 16 B .. 64 MiB
QWEN3_MOE = {"_name_or_path": "Qwen/Qwen3-30B-A3B", "hidden_size": 2048, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
             "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936}
PCIE = [g for g in GPUS.values() if g.link != "nvlink"]


def _moe(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_MOE))
    return str(path)


def test_the_pcie_presets_are_the_gpus_without_nvlink():
    assert {g.name for g in PCIE} == {"h100-pcie", "l40s", "l4", "a10", "rtx-a6000", "rtx-6000-ada", "rtx-4090",
                                      "rtx-pro-6000"}
    assert get_gpu("rtx-4090").link == "pcie-host"  # GeForce: no peer-to-peer, NCCL through host memory
    # RTX PRO 6000: peer-to-peer depends on the build; the real TP2 and DP2 + EP runs on two of them moved
    # their bytes through host memory (bench/real_runs), so that is the default, and link= says otherwise
    assert get_gpu("rtx-pro-6000").link == "pcie-host"
    p2p = make_runner("roofline:model=qwen2.5-32b,gpu=rtx-pro-6000,tp=2,link=pcie")
    host = make_runner("roofline:model=qwen2.5-32b,gpu=rtx-pro-6000,tp=2")
    assert p2p.gpu.link == "pcie" and p2p.gpu.name == host.gpu.name == "rtx-pro-6000"
    assert host.all_reduce_s(128) > p2p.all_reduce_s(128)  # every byte crosses PCIe twice
    with pytest.raises(ServelabError, match="link must be one of nvlink, pcie, pcie-host"):
        make_runner("roofline:gpu=rtx-pro-6000,link=infiniband")
    assert all(g.p2p_ranks == 0 for g in PCIE)
    with pytest.raises(ValueError, match="unknown link 'infiniband'"):
        dataclasses.replace(get_gpu("h100-80gb"), link="infiniband")


@pytest.mark.parametrize("gpu", PCIE, ids=lambda g: g.name)
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_all_reduce_over_pcie_is_never_faster_than_its_bytes_over_the_pcie_bandwidth(gpu, ranks):
    # the golden: a ring all-reduce moves 2 (p - 1)/p of the message out of every GPU
    r = make_runner(f"roofline:model=llama-3.1-70b,gpu={gpu.name},tp={ranks}")
    c = r.calibration
    for nbytes in SIZES:
        t = all_reduce_time_s(nbytes, ranks, gpu.interconnect_bytes_per_s, c.all_reduce_latency_s,
                              c.all_reduce_eff, gpu.p2p_ranks, r.custom_all_reduce, gpu.link)
        assert t >= 2 * (ranks - 1) / ranks * nbytes / gpu.interconnect_bytes_per_s
        assert t >= nbytes / gpu.interconnect_bytes_per_s
    for tokens in (1, 8, 64, 512, 4096):  # and the runner's own per-layer all-reduce of T x 8192 x 2 B
        assert r.all_reduce_s(tokens) >= 2 * (ranks - 1) / ranks * tokens * 8192 * 2 / gpu.interconnect_bytes_per_s


@pytest.mark.parametrize("gpu", GPUS.values(), ids=lambda g: g.name)
def test_no_all_reduce_beats_its_ring_bytes_over_the_link_on_any_preset(gpu):
    r = make_runner(f"roofline:model=llama-3.1-70b,gpu={gpu.name},tp=8")
    for tokens in (1, 16, 31, 32, 511, 512, 8192):
        assert r.all_reduce_s(tokens) >= 1.75 * tokens * 16 * KIB / gpu.interconnect_bytes_per_s


def test_pcie_all_reduce_costs_more_than_nvlink_at_the_same_bandwidth_by_hand():
    # TP2 of a 32B dense model (hidden 5120) on RTX PRO 6000 (PCIe 5.0 x16, 64 GB/s, A40 NCCL fit), on a
    # build where peer-to-peer works (link=pcie; the preset's default is through host memory)
    pcie = make_runner("roofline:model=qwen2.5-32b,gpu=rtx-pro-6000,tp=2,link=pcie")
    as_nvlink = dataclasses.replace(pcie, gpu=dataclasses.replace(pcie.gpu, link="nvlink"))
    c = pcie.calibration
    nbytes = 32 * 5120 * 2  # a decode batch of 32
    assert pcie.all_reduce_s(32) == pytest.approx(
        c.all_reduce_latency_s + 2 * 2.3e-6 + nbytes / (64e9 * c.all_reduce_eff * 54 / 63), rel=1e-12)
    assert as_nvlink.all_reduce_s(32) == pytest.approx(c.all_reduce_latency_s + nbytes / (64e9 * c.all_reduce_eff),
                                                       rel=1e-12)
    # no peer-to-peer (RTX 4090): every byte crosses PCIe twice, through host memory
    host = make_runner("roofline:model=llama-3.1-8b,gpu=rtx-4090,tp=2")
    assert host.all_reduce_s(32) == pytest.approx(
        c.all_reduce_latency_s + 2 * 2.3e-6 + 32 * 4096 * 2 / (32e9 * c.all_reduce_eff * 27 / 63), rel=1e-12)
    plan = StepPlan(StepShape(decode_seqs=32, decode_context_tokens=32 * 1000))
    assert pcie.step_time(plan) - as_nvlink.step_time(plan) == pytest.approx(
        64 * 2 * (pcie.all_reduce_s(32) - as_nvlink.all_reduce_s(32)), rel=1e-9)


def test_nvlink_pricing_is_unchanged_by_the_link_terms():
    # the NVLink link adds nothing: the NCCL fit and vLLM's custom kernels as before
    assert LINKS["nvlink"].step_latency_s == 0.0 and LINKS["nvlink"].bandwidth_share == 1.0
    r = make_runner("roofline:model=llama-2-70b,gpu=h100-80gb,tp=4,all_reduce=nccl")
    c = r.calibration
    assert r.all_reduce_s(512) == c.all_reduce_latency_s + 1.5 * 512 * 16 * KIB / (450e9 * c.all_reduce_eff)


@pytest.mark.parametrize("gpu", ["h100-80gb", "rtx-pro-6000", "l40s", "rtx-4090"])
def test_all_to_all_is_never_faster_than_its_bytes_over_the_link(gpu, tmp_path):
    r = make_runner(f"roofline:model={_moe(tmp_path)},gpu={gpu},tp=1,dp=2,ep=2")
    bw = r.gpu.interconnect_bytes_per_s
    for tokens in (1, 7, 64, 2048):
        # vLLM's allgather_reducescatter: each DP rank's T tokens to the other GPU once (not once per
        # expert: 8 experts, ~4 of them there), x 2048 x 2 B
        assert r.all_to_all_bytes(tokens) == tokens * 1 * 2048 * 2
        assert r.all_to_all_s(tokens) >= r.all_to_all_bytes(tokens) / bw
    # a ring of ep - 1 = 1 step: the NCCL fit's latency and the link's step latency once
    c, link = r.calibration, LINKS[r.gpu.link]
    assert r.all_to_all_s(2048) == pytest.approx(c.all_reduce_latency_s + link.step_latency_s + r.all_to_all_bytes(2048)
                                                 / (bw * c.all_reduce_eff * link.bandwidth_share), rel=1e-12)


def test_dp_attention_with_expert_parallel_moe_by_hand(tmp_path):
    path = _moe(tmp_path)
    one = make_runner(f"roofline:model={path},gpu=h100-80gb")
    dpep = make_runner(f"roofline:model={path},gpu=h100-80gb", dp=2, enable_expert_parallel=True)
    assert (dpep.tp, dpep.dp, dpep.ep) == (1, 2, 2)
    m = one.model
    # weights per GPU: attention and the other dense weights on each rank, half of the 128 experts
    experts = 48 * 128 * 3 * 2048 * 768 * 2
    from servelab.runners.roofline import weight_bytes_per_gpu

    assert m.expert_params * 2 == experts
    assert weight_bytes_per_gpu(m, 1, 2, 1) == (m.weight_bytes - experts) + experts / 2
    # each DP rank is its own engine with its own KV cache, larger than one GPU's with every expert
    assert dpep.kv_capacity_tokens(0.9) > one.kv_capacity_tokens(0.9)
    gained = experts / 2 / m.kv_bytes_per_token
    assert dpep.kv_capacity_tokens(0.9) - one.kv_capacity_tokens(0.9) == pytest.approx(gained, abs=1)
    # one decode per rank: each rank reads the experts both ranks' tokens route to, halved;
    # the step adds a dispatch and a combine per layer
    plan = StepPlan(StepShape(decode_seqs=1, decode_context_tokens=500))
    expert_read_s = one._ops[2][3] + one._ops[4][3]  # mlp_up + mlp_down weights of one expert, per layer
    saved = 48 * expert_read_s * (m.experts_touched(1) - m.experts_touched(2) / 2)
    comm = 48 * 2 * dpep.all_to_all_s(1)
    assert dpep.step_time(plan) - one.step_time(plan) == pytest.approx(comm - saved, rel=1e-6)
    # the same DP ranks without expert parallelism: experts tensor-parallel over the 2 GPUs, tokens
    # gathered and reduce-scattered (one all-reduce of both ranks' tokens)
    dp_only = make_runner(f"roofline:model={path},gpu=h100-80gb,dp=2")
    assert dp_only.ep == 1 and dp_only.dp_expert_all_reduce_s(8) > 0
    assert dp_only.dp_expert_all_reduce_s(8) >= 2 * 8 * 2048 * 2 / 2 / 450e9
    # a dense model's DP ranks are plain replicas: priced as one GPU
    dense = make_runner("roofline:model=llama-3.1-8b", dp=2, enable_expert_parallel=True)
    assert dense.ep == 1 and dense.step_time(plan) == make_runner("roofline:model=llama-3.1-8b").step_time(plan)


def test_expert_parallel_size_must_be_tp_times_dp(tmp_path):
    path = _moe(tmp_path)
    with pytest.raises(ServelabError, match=r"ep equal to tp x dp \(1 x 2\)"):
        make_runner(f"roofline:model={path},dp=2,ep=4")
    with pytest.raises(ServelabError, match="dp=0 must be >= 1"):
        make_runner(f"roofline:model={path},dp=0")
    with pytest.raises(ServelabError, match=r"pp=49 in 1\.\.48"):
        make_runner(f"roofline:model={path},pp=49")


@pytest.mark.parametrize("gpu", ["h100-80gb", "l40s", "rtx-4090"])
def test_pipeline_stage_transfer_is_never_faster_than_its_bytes_over_the_link(gpu):
    for tp in (1, 2):
        r = make_runner(f"roofline:model=llama-3.1-8b,gpu={gpu},tp={tp},pp=2")
        bw = r.gpu.interconnect_bytes_per_s
        for tokens in (1, 100, 2048):
            # hidden states and residual: 2 x T x 4096 x 2 B, split over the tp senders
            assert r.stage_send_bytes(tokens) == 2 * tokens * 4096 * 2 / tp
            assert r.stage_send_s(tokens) >= 2 * tokens * 4096 * 2 / tp / bw
    c = r.calibration
    assert send_time_s(1e6, 450e9, c.all_reduce_latency_s, c.all_reduce_eff) >= 1e6 / 450e9


def test_pipeline_step_is_stages_in_turn_plus_sends_by_hand():
    one = make_runner("roofline:model=llama-3.1-8b,gpu=h100-80gb")
    pp2 = make_runner("roofline:model=llama-3.1-8b,gpu=h100-80gb,pp=2")
    pp3 = make_runner("roofline:model=llama-3.1-8b,gpu=h100-80gb,pp=3")
    for plan in (StepPlan(StepShape(decode_seqs=16, decode_context_tokens=16 * 700)),
                 StepPlan(StepShape(prefill_tokens=1024, prefill_seqs=1, prefill_attention_pairs=1024 * 1025 // 2))):
        s = plan.shape
        tokens, seqs = s.prefill_tokens + s.decode_seqs, s.prefill_seqs + s.decode_seqs
        layer, _, comm, emb, norm = pp3._by_tokens(tokens)
        layer += pp3.prefill_attention_s(s) + comm + pp3._by_decodes(s.decode_seqs)
        lm, cpu = pp3._by_seqs(seqs)
        kv = pp3._rates.decode_s_per_kv_token / 33 * s.decode_context_tokens  # per layer
        stage = 11 * (layer + kv) + max(emb, norm + lm)  # 32 layers over 3 stages: the largest has 11
        assert pp3.step_time(plan) == pytest.approx(3 * stage + 2 * pp3.stage_send_s(tokens) + cpu, rel=1e-12)
        # 32 layers split evenly: a batch's latency is one GPU's plus the sends, the bubble, and the CPU
        # overhead of the extra worker; never less than one GPU running the whole model
        assert pp2.step_time(plan) > one.step_time(plan)
        extra = pp2.step_time(plan) - one.step_time(plan)
        assert extra >= pp2.stage_send_s(tokens)
    # decode_affine stays exact under PP
    a, b = pp3.decode_affine(24)
    for ctx in (0, 5000, 123457):
        assert pp3.step_time(StepPlan(StepShape(decode_seqs=24, decode_context_tokens=ctx))) == a + b * ctx


def test_pipeline_kv_capacity_by_hand():
    one = make_runner("roofline:model=llama-3.1-70b,gpu=h100-80gb,tp=4")
    pp2 = make_runner("roofline:model=llama-3.1-70b,gpu=h100-80gb,tp=4,pp=2")
    m, g = one.model, one.gpu
    from servelab.runners.roofline import activation_reserve_bytes

    reserve = activation_reserve_bytes(m, 4, pp2.activation_tokens, pp2.logit_seqs, pp2.non_torch_bytes)
    free = g.memory_bytes * 0.9 - m.weight_bytes / 8 - reserve
    assert pp2.kv_capacity_tokens(0.9) == int(free * 8 // m.kv_bytes_per_token)
    assert pp2.kv_capacity_tokens(0.9) > 2 * one.kv_capacity_tokens(0.9)  # half the weights per GPU, twice the GPUs
    with pytest.raises(ServelabError, match=r"tp 1 x dp 1 x pp 2 rtx-4090 .* weights alone need 65\.\d GiB per GPU"):
        make_runner("roofline:model=llama-3.1-70b,gpu=rtx-4090,pp=2").kv_capacity_tokens(0.9)


def test_describe_round_trips_dp_pp_ep(tmp_path):
    from servelab.runners.roofline import RooflineRunner

    r = make_runner(f"roofline:model={_moe(tmp_path)},gpu=rtx-pro-6000,tp=2,dp=2,pp=2,ep=4")
    back = RooflineRunner.from_describe(json.loads(json.dumps(r.describe())))
    assert (back.dp, back.pp, back.ep) == (2, 2, 4)
    plan = StepPlan(StepShape(decode_seqs=8, decode_context_tokens=4000))
    assert back.step_time(plan) == r.step_time(plan)
    import pickle

    assert pickle.loads(pickle.dumps(r)).step_time(plan) == r.step_time(plan)


# --- the replay: options, engines per replica, GPU counts ------------------------------------------

def test_config_takes_vllms_names_and_keeps_its_form_without_them():
    from servelab.replay.config import ReplayConfig

    c = ReplayConfig.from_dict({"data_parallel_size": 2, "enable_expert_parallel": "true", "pipeline_parallel_size": 1})
    assert (c.dp, c.pp, c.enable_expert_parallel) == (2, 1, True)
    assert c.to_dict()["dp"] == 2 and c.to_dict()["enable_expert_parallel"] is True and "pp" not in c.to_dict()
    assert ReplayConfig.from_dict(c.to_dict()) == c
    assert not {"dp", "pp", "enable_expert_parallel"} & set(ReplayConfig().to_dict())
    assert (ReplayConfig.from_dict({"tp": 2, "dp": 2, "pp": 2}).gpus_per_replica,
            ReplayConfig.from_dict({"tp": 2, "dp": 2, "pp": 2}).engines_per_replica) == (8, 4)
    with pytest.raises(ServelabError, match="dp must be >= 1"):
        ReplayConfig.from_dict({"dp": 0})
    with pytest.raises(ServelabError, match="data_parallel_size: expected a finite int"):
        ReplayConfig.from_dict({"data_parallel_size": "two"})


def test_cli_options_follow_vllms_flags():
    from click.testing import CliRunner
    from servelab.cli.replay_cmd import config_from_options, replay_options

    import click

    seen = {}

    @click.command()
    @replay_options
    def cmd(**options):
        seen["config"] = config_from_options(**options)

    result = CliRunner().invoke(cmd, ["--dp", "2", "--enable-expert-parallel", "--pp", "2", "--tp", "2"])
    assert result.exit_code == 0, result.output
    assert (seen["config"].dp, seen["config"].pp, seen["config"].enable_expert_parallel) == (2, 2, True)
    CliRunner().invoke(cmd, ["--data-parallel-size", "4", "--no-enable-expert-parallel"])
    assert (seen["config"].dp, seen["config"].enable_expert_parallel) == (4, False)


def _trace(n=40):
    from conftest import make_trace

    return make_trace([i * 0.05 for i in range(n)], [300 + 7 * i for i in range(n)], [20 + i % 5 for i in range(n)])


def test_dp_ranks_and_pp_stages_are_engines_and_gpus(tmp_path):
    from servelab.api import replay
    from servelab.replay.config import ReplayConfig
    from servelab.scoring.sources import num_gpus, pool_rows

    path = _moe(tmp_path)
    trace = _trace()
    single = replay(trace, ReplayConfig(model=path))
    dpep = replay(trace, ReplayConfig(model=path, dp=2, enable_expert_parallel=True))
    assert set(single.requests.column("replica").to_pylist()) == {0}
    assert set(dpep.requests.column("replica").to_pylist()) == {0, 1}  # round-robin over the two DP ranks
    assert num_gpus(single.meta) == 1 and num_gpus(dpep.meta) == 2
    assert pool_rows(dpep.meta)[0]["gpus"] == 2
    assert dpep.meta["runner"]["params"]["ep"] == 2
    pp = replay(trace, ReplayConfig.from_dict({"tp": 2, "pp": 2, "num_gpu_blocks": 1001}))
    assert set(pp.requests.column("replica").to_pylist()) == {0, 1}
    assert num_gpus(pp.meta) == 4
    assert pp.meta["engine"]["num_gpu_blocks"] == 1001  # as vLLM reports it; each stage's engine has 500
    assert num_gpus({"config": {"tp": 2, "data_parallel_size": 2}, "engine": {"replicas": 3}}) == 12


def test_cluster_refuses_dp_and_pp():
    from servelab.replay.cluster.config import ClusterConfig, PoolConfig
    from servelab.replay.config import ReplayConfig

    with pytest.raises(ServelabError, match=r"dp and pp apply to a replay without a \[cluster\]"):
        ReplayConfig(dp=2, cluster=ClusterConfig((PoolConfig("a", "mixed", 1),)))


def test_validate_real_reads_the_runs_parallel_settings():
    from servelab.fidelity.validate import config_for

    meta = {"config": {"model": "meta-llama/Llama-3.1-8B", "gpu": "h100-80gb", "tp": 1, "data_parallel_size": 2,
                       "enable_expert_parallel": True, "pipeline_parallel_size": 1}}
    c = config_for(meta, {})
    assert (c.dp, c.pp, c.enable_expert_parallel) == (2, 1, True)
    assert config_for(meta, {"dp": 1}).dp == 1  # an option wins over the run's setting


def test_a_dp_ep_run_imported_and_validated_replays_as_dp_ranks(tmp_path, capsys):
    # a vLLM run with --data-parallel-size 2 --enable-expert-parallel, as its meta.json records it:
    # run import counts the ranks as replicas and keeps vLLM's arguments; validate --real replays one
    # replica of two DP ranks with the experts spread over both GPUs
    import shutil
    from pathlib import Path

    from helpers_cli import run_main
    from servelab.fidelity.validate import config_for, validate_real

    fixture = Path(__file__).parent / "fixtures" / "real_runs" / "rtx4090"
    src = tmp_path / "run"
    src.mkdir()
    shutil.copy(fixture / "requests.jsonl", src / "requests.jsonl")
    meta = json.loads((fixture / "meta.json").read_text())
    meta["model"] = meta["engine_kwargs"]["model"] = _moe(tmp_path)
    meta["engine_kwargs"].update(data_parallel_size=2, enable_expert_parallel=True, kv_cache_dtype="fp8")
    (src / "meta.json").write_text(json.dumps(meta))
    out = tmp_path / "imported"
    code, stdout, err = run_main(["run", "import", "--format", "timestamps-jsonl", str(src / "requests.jsonl"),
                                  "-o", str(out), "--setting", "gpu=h100-80gb"], capsys)
    assert code == 0, stdout + err
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["replicas"] == 2 and run["source"]["enable_expert_parallel"] is True
    c = config_for(run, {})
    assert (c.engine.replicas, c.dp, c.enable_expert_parallel, c.kv_cache_dtype) == (1, 2, True, "fp8")
    assert config_for(run, {"replicas": 2}).dp == 1  # an option wins: two replicas as given
    report, _, simulated = validate_real(out, {})
    assert set(simulated.column("replica").to_pylist()) <= {0, 1}
    used = {row["setting"]: row for row in report["settings"]}
    assert used["dp"]["value"] == 2 and used["dp"]["from"] == "run: vLLM's arguments (run.json source)"
    assert used["replicas"]["value"] == 1 and "pp" not in used  # listed only when set
    # vLLM's API server balances its DP ranks by 4 x waiting + running: the replay's router for them
    assert c.engine.router == "vllm-dp" and used["router"]["value"] == "vllm-dp"
    assert used["router"]["from"].startswith("run: vLLM balances its DP ranks")
    assert config_for(run, {"router": "round-robin"}).engine.router == "round-robin"  # an option wins
    # the printed report names every GPU of the server, and the KV blocks as each rank's
    code, text, err = run_main(["validate", "--real", str(out)], capsys)
    assert code == 0, err
    flat = " ".join(text.split())
    assert "on 2 x h100-80gb (tp 1 x dp 2, expert parallel)" in flat and "tokens per DP rank" in flat
