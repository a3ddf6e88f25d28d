"""A runner spec is typed once, at the edge (issue #27 item 3): ``"linear:base=0.01"`` becomes a `RunnerSpec`
(the runner's name and its frozen ``Params``) when the config is made, so a bad key or value fails there,
naming the spec, the key and the type, before any trace is read; building a cluster's runners parses
nothing again; and the spec is written back as it was given (run.json, ``to_dict``)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import servelab.replay.core.runner_spec as runner_spec_module
from helpers_cli import PD_8_REPLICAS_TOML, run_main, write_small_trace
from helpers_engine import string_splits
from servelab.api import build_runner, replay
from servelab.common.errors import InputError, ServelabError
from servelab.replay.config import EngineConfig, Options, ReplayConfig, pool_config
from servelab.runners.base import RunnerSpec, make_runner, runner_spec
from servelab.runners.fitted import FittedParams
from servelab.runners.linear import LinearParams
from servelab.runners.roofline import RooflineParams
from servelab.traces.io import read_trace

RUNNERS_DIR = Path(runner_spec_module.__file__).resolve().parents[2] / "runners"


# -- a bad spec fails when the config is made, naming the spec, the key and the type ---------------------

@pytest.mark.parametrize("spec, message", [
    ("linear:base=abc", "runner 'linear:base=abc': base: expected a finite float, got 'abc'"),
    ("roofline:tp=two", "runner 'roofline:tp=two': tp: expected a finite int, got 'two'"),
    ("roofline:tpp=2", "runner 'roofline:tpp=2': unknown parameter 'tpp'; did you mean 'tp'?"),
    ("torch:model=tiny,warmup=maybe", "runner 'torch:model=tiny,warmup=maybe': warmup: expected bool, got 'maybe'"),
    ("fitted:m.json,scale=2", "runner 'fitted:m.json,scale=2': unknown parameter 'scale'"),
    ("linear:base=-1", "runner 'linear:base=-1': term 'base' must be >= 0, got -1.0"),
    ("roofline:all_reduce=ring", "runner 'roofline:all_reduce=ring': all_reduce must be one of auto, nccl"),
])
def test_a_bad_runner_value_in_a_toml_config_fails_when_the_config_is_read(tmp_path, spec, message):
    path = tmp_path / "c.toml"
    path.write_text(f'runner = "{spec}"\nnum_gpu_blocks = 100\n')
    with pytest.raises(ServelabError) as err:
        ReplayConfig.from_toml(path)  # (main's code read it, and failed only when the runner was built)
    assert str(err.value).startswith(f"{path}: {message}")


def test_a_bad_runner_value_of_a_cluster_pool_or_instance_type_names_where_it_is(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[[cluster.pools]]\nname = "web"\nreplicas = 2\nrunner = "roofline:tp=two"\n')
    with pytest.raises(ServelabError, match=rf"^{path}: cluster.pools\[0\].runner: runner 'roofline:tp=two': tp: "
                                            r"expected a finite int, got 'two'$"):
        ReplayConfig.from_toml(path)
    path.write_text('[[cluster.pools]]\nname = "web"\nreplicas = 2\n'
                    'instances = [{gpu = "a100-80gb", runner = "linear:bse=0.01"}]\n')
    with pytest.raises(ServelabError, match=rf"^{path}: cluster.pools\[0\].instances\[0\].runner: runner "
                                            r"'linear:bse=0.01': unknown parameter 'bse'; did you mean 'base'\?"):
        ReplayConfig.from_toml(path)


def test_a_bad_runner_flag_fails_before_the_trace_is_opened(tmp_path, capsys, monkeypatch):
    """``--runner`` with a cluster config: main's code opened the trace (its prefix-hash block size) and built
    the pools before the spec's value failed; now the options' config refuses it."""
    import servelab.replay.stream

    opened = []
    monkeypatch.setattr(servelab.replay.stream, "TraceFile", lambda *a, **k: opened.append(a) or 1 / 0)
    monkeypatch.setattr("servelab.traces.io.read_trace", lambda *a, **k: opened.append(a) or 1 / 0)
    trace = write_small_trace(tmp_path)
    path = tmp_path / "c.toml"
    path.write_text('num_gpu_blocks = 100\n[[cluster.pools]]\nname = "web"\nreplicas = 2\n')
    code, _, err = run_main(["replay", trace, "--config", path, "--runner", "linear:base=0.01,decode_seq=x",
                             "-o", tmp_path / "run", "--no-report"], capsys)
    assert code != 0 and "runner 'linear:base=0.01,decode_seq=x': decode_seq: expected a finite float, got 'x'" in err
    assert opened == [] and not (tmp_path / "run").exists()


# -- parsed once: a cluster of 8 replicas builds its runners from the typed spec ----------------------------

CLUSTER = PD_8_REPLICAS_TOML


def spec_string_calls(run) -> tuple[list[str], object]:
    """``str.split`` / ``str.partition`` calls made from runners/ files and the spec module while ``run()`` runs
    (a runner spec split into its keys again), and its result."""
    return string_splits(run, {RUNNERS_DIR, Path(runner_spec_module.__file__)}, names=("split", "partition"))


def test_a_cluster_of_8_replicas_parses_its_runner_spec_once(tmp_path, monkeypatch):
    made, parsed = [], []
    check, split = RooflineParams.__post_init__, runner_spec_module.split_spec
    monkeypatch.setattr(RooflineParams, "__post_init__", lambda self: made.append(self) or check(self))
    monkeypatch.setattr(runner_spec_module, "split_spec", lambda text: parsed.append(text) or split(text))
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER)
    trace = read_trace(write_small_trace(tmp_path))
    config = ReplayConfig.from_toml(path)
    assert parsed == ["roofline:cpu_overhead=0.5"] and len(made) == 1  # the top level's spec, typed once
    pools = [pool_config(config, p) for p in config.cluster.pools]
    assert pools[0].runner is pools[1].runner is config.runner  # each pool holds the one typed spec

    made.clear(), parsed.clear()
    splits, result = spec_string_calls(lambda: replay(trace, config))
    assert result.meta["counts"]["finished"] == 20
    assert [len(p["replicas"]) for p in result.meta["cluster"]["pools"]] == [4, 4]
    assert made == parsed == splits == []  # 2 runners (one per GPU) for 8 replicas: nothing parsed again
    assert [p["runner"] for p in result.meta["cluster"]["pools"]] == ["roofline:cpu_overhead=0.5"] * 2


def test_options_carry_a_typed_spec_over_many_configs():
    options = Options.parse({"runner": "linear:base=0.01"}, "spec.toml")
    typed = options.get("runner")
    assert typed == RunnerSpec("linear", LinearParams(base=0.01))
    configs = [ReplayConfig(engine=EngineConfig(seed=s)).with_options(options) for s in range(3)]
    assert all(c.runner is typed for c in configs)  # typed once, for every config it goes over
    assert replace(configs[0], tp=2).runner is typed  # a variant keeps it as it is


# -- the text round trip, for every runner -------------------------------------------------------------------

SPECS = ["roofline", "roofline:model=gemma-3-27b,gpu=h100-80gb,tp=2", "roofline:quantization=none,host=vidur-2023",
         "linear:base=0.04,prefill_token=0.0004", "linear:base=1e-3", "fitted:model.json", "fitted:path=runs/m.json",
         "torch:model=tiny,device=cpu", "torch:model=tiny,device=cuda:0,warmup=0,block_size=256"]


@pytest.mark.parametrize("text", SPECS)
def test_string_to_typed_to_string_is_stable(text):
    spec = runner_spec(text)
    assert str(spec) == text  # written as given: run.json and to_dict keep the user's spec
    again = RunnerSpec(spec.name, spec.params)  # the text made from the typed params
    assert runner_spec(str(again)) == spec == again and str(runner_spec(str(again))) == str(again)
    config = ReplayConfig(runner=text)
    assert config.to_dict()["runner"] == text and ReplayConfig.from_dict(config.to_dict()) == config


def test_the_typed_values():
    assert runner_spec("linear:base=1e-3") == runner_spec("linear:base=0.001")  # the same runner, written twice
    assert str(RunnerSpec("linear", LinearParams(base=0.001))) == "linear:base=0.001"
    roof = runner_spec("roofline:tp=2,quantization=none,cpu_overhead=0").params
    assert (roof.tp, roof.quantization, roof.cpu_overhead, roof.gpu) == (2, "none", 0.0, None)  # "none": a value
    assert runner_spec("fitted:runs/m.json").params == FittedParams(Path("runs/m.json"))
    assert str(RunnerSpec("fitted", FittedParams(Path("m.json")))) == "fitted:m.json"
    with pytest.raises(ServelabError, match="more than one positional value"):
        runner_spec("fitted:a.json,b.json")
    with pytest.raises(ServelabError, match=r"runner 'roofline:x': 'x' needs a key"):
        runner_spec("roofline:x")
    with pytest.raises(ServelabError, match="unknown runner 'nosuch'"):
        ReplayConfig(runner="nosuch")
    with pytest.raises(ServelabError, match="runner: expected a spec string"):
        ReplayConfig.from_dict({"runner": 3})
    with pytest.raises(TypeError, match="takes its typed LinearParams"):
        RunnerSpec("linear", RooflineParams())


def test_the_torch_runners_params_type_without_torch():
    """The torch runner's Params are typed and checked in a process without torch (imported when it is built)."""
    code = ("import sys\nfrom servelab.runners.base import runner_spec\n"
            "p = runner_spec('torch:model=tiny,device=cpu,seed=3,warmup=false,dtype=float32').params\n"
            "assert (p.seed, p.warmup, p.dtype, p.block_size) == (3, False, 'float32', None), p\n"
            "try:\n    runner_spec('torch:dtype=fp3')\nexcept Exception as e:\n    print(e)\n"
            "assert 'torch' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "runner 'torch:dtype=fp3': dtype must be one of float32, bfloat16, float16, got 'fp3'"


# -- building: the context's defaults, the spec's values win, the fitted file read then -------------------------

def test_context_defaults_and_spec_values_when_built():
    config = ReplayConfig(runner="roofline:tp=2", model="mistral-7b", gpu="a100-80gb", tp=4)
    runner = build_runner(config)
    assert (runner.model.name, runner.gpu.name, runner.tp) == ("mistral-7b", "a100-80gb", 2)
    assert make_runner(config.runner, gpu="l40s").gpu.name == "l40s"  # typed spec or string alike
    assert make_runner("roofline:gpu=l40s", gpu="a100-80gb").gpu.name == "l40s"


def test_the_config_records_the_model_gpu_and_tp_the_spec_sets(tmp_path, capsys):
    """A spec's model/GPU/TP win, so the config (run.json, the report's header, the GPU-hour cost) names
    them, not the replay's defaults; a config file's pools alike; a linear runner leaves the config's."""
    config = ReplayConfig(runner="roofline:model=qwen3-8b,gpu=l40s,tp=2", model="mistral-7b", gpu="a100-80gb")
    assert (config.model, config.gpu, config.tp) == ("qwen3-8b", "l40s", 2)
    assert ReplayConfig.from_dict(config.to_dict()) == config
    assert config.with_options({"model": "llama-3.1-8b"}).model == "qwen3-8b"  # the spec still wins
    assert ReplayConfig(runner="linear:base=0.01", model="mistral-7b").model == "mistral-7b"
    trace = write_small_trace(tmp_path)
    out = tmp_path / "run"
    code, text, err = run_main(["replay", trace, "--runner", "roofline:model=qwen3-8b,gpu=l40s,tp=2", "--out", out],
                               capsys)
    assert code == 0, err
    assert "model qwen3-8b  GPU l40s  TP 2" in text
    recorded = json.loads((out / "run.json").read_text())["config"]
    assert (recorded["model"], recorded["gpu"], recorded["tp"]) == ("qwen3-8b", "l40s", 2)


def test_a_fitted_path_is_typed_at_the_edge_and_read_when_built(tmp_path):
    config = ReplayConfig(runner=f"fitted:{tmp_path / 'missing.json'}")  # made: no file read
    assert config.runner.params.path == tmp_path / "missing.json"
    with pytest.raises(InputError, match="fitted model file not found"):
        build_runner(config)
