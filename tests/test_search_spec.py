"""Search spec: the issue's minimal spec parses with defaults; every bad-input rule names the file and key and writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers_search import write_trace_file
from servelab.cli.main import main
from servelab.common.errors import InputError
from servelab.search.spec import load_spec

MINIMAL = """
trace = "traces/conv.arrow"
objective = "attainment"
n_trials = 50
seed = 0
[slo]
ttft_s = 2.0
tpot_s = 0.1
[space]
max_num_seqs = { low = 8, high = 512, log = true }
max_num_batched_tokens = { low = 256, high = 16384, log = true }
block_size = [8, 16, 32]
policy = ["sarathi", "vllm-v0"]
"""


def test_minimal_spec_from_the_issue(tmp_path):
    path = tmp_path / "min.toml"
    path.write_text(MINIMAL)
    spec = load_spec(path)
    assert spec.trace.path == tmp_path / "traces" / "conv.arrow"  # relative to the spec file
    assert spec.objectives == ("attainment",) and spec.directions == ("maximize",)
    assert spec.sampler == "tpe" and spec.pruner == "none" and spec.workers is None and spec.storage is None  # workers: "auto"
    assert spec.target == 0.9 and spec.study_name == "min"
    by_name = {p.name: p for p in spec.space}
    assert by_name["max_num_seqs"].kind == "int" and by_name["max_num_seqs"].log
    assert by_name["block_size"].choices == (8, 16, 32)
    assert by_name["policy"].choices == ("sarathi", "vllm-v0")
    assert spec.slo.global_.ttft_s == 2.0


def test_policy_parameter_forms(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("""
trace = "t.arrow"
objective = ["goodput", "ttft_p99"]
sampler = { name = "nsga2", population_size = 10 }
[space]
policy = ["sarathi", "round-robin"]
"policy_params.long_prefill_threshold" = { low = 0, high = 2048, step = 256 }
[space.policy_params.round-robin]
quantum = [1, 2, 4]
""")
    spec = load_spec(path)
    by_name = {p.name: p for p in spec.space}
    lpt = by_name["policy_params.long_prefill_threshold"]
    assert lpt.is_policy_param and lpt.policy is None and lpt.step == 256
    quantum = by_name["policy_params.round-robin.quantum"]
    assert quantum.policy == "round-robin" and quantum.key == "quantum"
    assert spec.directions == ("maximize", "minimize")
    assert dict(spec.sampler_options) == {"population_size": 10}


SPACE = '[space]\nmax_num_seqs = [8, 16]\n'
BAD = [
    ("unknown top-level key", 'trace = "t.arrow"\nbogus = 1\n' + SPACE, "bogus", "unknown key"),
    ("no trace", SPACE, "trace", "required"),
    ("no space", 'trace = "t.arrow"\n', "space", "required"),
    ("unknown trace key", '[trace]\npath = "t.arrow"\nspeed = 2\n' + SPACE, "trace.speed", "unknown key"),
    ("bad window", '[trace]\npath = "t.arrow"\nwindow_s = [10, 5]\n' + SPACE, "trace.window_s", "start_s < end_s"),
    ("two rates", '[trace]\npath = "t.arrow"\nrate_scale = 2\nrate_rps = 3\n' + SPACE, "trace.rate_rps", "not both"),
    ("bad replay key", 'trace = "t.arrow"\n[replay]\nmax_seqs = 3\n' + SPACE, "replay", "unknown key 'max_seqs'"),
    ("bad target", 'trace = "t.arrow"\ntarget = 1.5\n' + SPACE, "target", "(0, 1]"),
    ("bad slo field", 'trace = "t.arrow"\n[slo]\nttft = "fast"\n' + SPACE, "slo.ttft", "number of seconds"),
    ("unknown objective", 'trace = "t.arrow"\nobjective = "speed"\n' + SPACE, "objective", "unknown objective 'speed'"),
    ("unknown parameter", 'trace = "t.arrow"\n[space]\nmax_seqs = [1, 2]\n', "space.max_seqs", "unknown parameter"),
    ("low >= high", 'trace = "t.arrow"\n[space]\nmax_num_seqs = { low = 64, high = 8 }\n', "space.max_num_seqs",
     "must be below high"),
    ("log with low 0", 'trace = "t.arrow"\n[space]\nswap_space_gb = { low = 0, high = 8, log = true }\n',
     "space.swap_space_gb", "log range needs low > 0"),
    ("float bounds on an int", 'trace = "t.arrow"\n[space]\nmax_num_seqs = { low = 1.5, high = 8 }\n',
     "space.max_num_seqs", "integer low and high"),
    ("log and step", 'trace = "t.arrow"\n[space]\nmax_num_seqs = { low = 1, high = 8, log = true, step = 2 }\n',
     "space.max_num_seqs", "cannot be combined"),
    ("range on a string", 'trace = "t.arrow"\n[space]\nrouter = { low = 1, high = 2 }\n', "space.router",
     "needs a list of choices"),
    ("invalid choice", 'trace = "t.arrow"\n[space]\npreemption = ["recompute", "drop"]\n', "space.preemption",
     "preemption must be one of"),
    ("endpoint invalid", 'trace = "t.arrow"\n[space]\nmax_num_seqs = { low = 0, high = 8 }\n', "space.max_num_seqs",
     "max_num_seqs must be >= 1"),
    ("wrong choice type", 'trace = "t.arrow"\n[space]\nblock_size = [8, "big"]\n', "space.block_size", "is not a int"),
    ("empty choices", 'trace = "t.arrow"\n[space]\nblock_size = []\n', "space.block_size", "must not be empty"),
    ("fixed value", 'trace = "t.arrow"\n[space]\nblock_size = 16\n', "space.block_size", "belongs in [replay]"),
    ("unknown policy", 'trace = "t.arrow"\n[space]\npolicy = ["sarathi", "fifo"]\n', "space.policy",
     "unknown policy 'fifo'"),
    # a misspelt name is refused before any trial runs (each trial was once pruned "infeasible", exit 0)
    ("misspelt policy", 'trace = "t.arrow"\n[space]\npolicy = ["sarathi", "sarathy"]\n', "space.policy",
     "unknown policy 'sarathy'; did you mean 'sarathi'?"),
    ("unknown base gpu", 'trace = "t.arrow"\ngpu = "x100"\n' + SPACE, "gpu", "unknown GPU preset 'x100'"),
    ("unknown replay model", 'trace = "t.arrow"\n[replay]\nmodel = "lama-3.1-8b"\n' + SPACE, "replay.model",
     "unknown model preset 'lama-3.1-8b'; did you mean 'llama-3.1-8b'?"),
    ("unknown gpu choice", 'trace = "t.arrow"\n[space]\ngpu = ["h100-80gb", "x100"]\n', "space.gpu",
     "unknown GPU preset 'x100'"),
    ("unknown model choice", 'trace = "t.arrow"\n[space]\nmodel = ["llama-3.1-8b", "lama-3.1-8b"]\n', "space.model",
     "unknown model preset 'lama-3.1-8b'; did you mean 'llama-3.1-8b'?"),
    ("unknown router choice", 'trace = "t.arrow"\n[space]\nrouter = ["round-robin", "leastkv"]\n', "space.router",
     "unknown router 'leastkv'; did you mean 'least-kv'?"),
    ("unknown runner choice", 'trace = "t.arrow"\n[space]\nrunner = ["roofline", "roofine"]\n', "space.runner",
     "unknown runner 'roofine'; did you mean 'roofline'?"),
    ("unknown pool gpu", 'trace = "t.arrow"\n[[cluster.pools]]\nname = "web"\ngpu = "x100"\n[space]\n'
     '"pools.web.replicas" = [1, 2]\n', "cluster.pools[0].gpu", "unknown GPU preset 'x100'"),
    ("unknown pool gpu choice", 'trace = "t.arrow"\n[[cluster.pools]]\nname = "web"\n[space]\n'
     '"pools.web.gpu" = ["h100-80gb", "x100"]\n', "space.pools.web.gpu", "unknown GPU preset 'x100'"),
    ("unknown instance type", 'trace = "t.arrow"\n[[cluster.pools]]\nname = "web"\ninstances = [{ gpu = "x100" }]\n'
     '[space]\n"pools.web.replicas" = [1, 2]\n', "cluster.pools[0].instances[0].gpu", "unknown GPU preset 'x100'"),
    ("policy param of no policy in play", 'trace = "t.arrow"\n[space]\n"policy_params.quantum" = [1, 2]\n',
     "space.policy_params.quantum", "no policy in play"),
    ("params of a policy not in play", 'trace = "t.arrow"\n[space.policy_params.round-robin]\nquantum = [1, 2]\n',
     "space.policy_params.round-robin", "neither the base policy"),
    ("unknown policy param", 'trace = "t.arrow"\n[space.policy_params.sarathi]\nchunk = [1, 2]\n',
     "space.policy_params.sarathi.chunk", "has no such parameter"),
    ("unknown sampler", 'trace = "t.arrow"\nsampler = "bayes"\n' + SPACE, "sampler", "unknown sampler 'bayes'"),
    ("unknown pruner", 'trace = "t.arrow"\npruner = "early"\n' + SPACE, "pruner", "unknown pruner 'early'"),
    ("pruning goodput", 'trace = "t.arrow"\nobjective = "goodput"\npruner = "median"\n' + SPACE, "pruner",
     "needs objective = \"attainment\""),
    ("bad checkpoints", 'trace = "t.arrow"\npruner = { name = "median", checkpoints = [0.5, 1.5] }\n' + SPACE,
     "pruner.checkpoints", "fractions of the trace span"),
    ("grid float range", 'trace = "t.arrow"\nsampler = "grid"\n[space]\nswap_space_gb = { low = 1, high = 8 }\n',
     "space.swap_space_gb", "needs choices or a step"),
    ("cmaes with two objectives", 'trace = "t.arrow"\nsampler = "cmaes"\nobjective = ["attainment", "cost"]\n' + SPACE,
     "sampler", "single objective"),
    ("missing gpu price", 'trace = "t.arrow"\nobjective = "cost"\n[cost]\ngpu_prices = { "a100-80gb" = 1.5 }\n' + SPACE,
     "cost.gpu_prices", "no price for GPU 'h100-80gb'"),
    ("bad n_trials", 'trace = "t.arrow"\nn_trials = 0\n' + SPACE, "n_trials", "must be >= 1"),
    ("bad timeout", 'trace = "t.arrow"\ntimeout = -5\n' + SPACE, "timeout", "must be > 0 seconds"),
    ("two timeouts", 'trace = "t.arrow"\ntimeout = 5\ntimeout_s = 5\n' + SPACE, "timeout", "given twice"),
    ("bad storage", 'trace = "t.arrow"\nstorage = "studies/x"\n' + SPACE, "storage", "database URL"),
    ("bad goodput tolerance", 'trace = "t.arrow"\n[goodput]\ntolerance = 2\n' + SPACE, "goodput.tolerance",
     "[0.0001, 1)"),
]


@pytest.mark.parametrize("text,key,rule", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec_names_file_and_key_and_writes_nothing(tmp_path, capsys, text, key, rule):
    write_trace_file(tmp_path, n=20, name="t.arrow")
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InputError) as err:
        load_spec(path)
    message = str(err.value)
    assert message.startswith(f"{path}, column '{key}'"), message
    assert rule in message, message
    out = tmp_path / "study"
    with pytest.raises(SystemExit) as exit_:
        main(["search", str(path), "-o", str(out), "--no-progress"])
    assert exit_.value.code == 1
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_spec_file_errors(tmp_path, capsys):
    with pytest.raises(InputError, match="no such spec file"):
        load_spec(tmp_path / "missing.toml")
    bad = tmp_path / "broken.toml"
    bad.write_text("trace = \n")
    with pytest.raises(InputError, match=r"broken.toml: invalid TOML"):
        load_spec(bad)


def test_missing_trace_file_fails_before_any_output(tmp_path, capsys):
    path = tmp_path / "s.toml"
    path.write_text('trace = "absent.arrow"\n' + SPACE)
    out = tmp_path / "study"
    with pytest.raises(SystemExit):
        main(["search", str(path), "-o", str(out), "--no-progress"])
    assert "absent.arrow: file not found" in capsys.readouterr().err
    assert not out.exists()


def test_cli_forms(tmp_path):
    """`search SPEC.toml`, `search run SPEC.toml`, and the sub-commands all parse."""
    from click.testing import CliRunner

    from servelab.cli.search_cmd import search

    runner = CliRunner()
    for args in (["--help"], ["run", "--help"], ["worker", "--help"], ["best", "--help"], ["plot", "--help"]):
        result = runner.invoke(search, args)
        assert result.exit_code == 0, result.output
    assert "SPEC.toml" in runner.invoke(search, ["run", "--help"]).output
    result = runner.invoke(search, [str(Path(tmp_path) / "nothing.toml"), "-o", str(tmp_path / "x")])
    assert result.exit_code != 0 and "no such spec file" in str(result.exception)


EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("search_*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_specs_parse(path):
    spec = load_spec(path)
    assert spec.trace.path.resolve().is_file()
    assert spec.space and spec.objectives


def test_a_study_recorded_with_unpriced_pools_at_0_resumes():
    """Unpriced pools were recorded as price 0.0, and are now left out: a study made then is the same study."""
    from servelab.search.spec import comparable_identity

    then = {"base": {"cluster": {"pools": [{"name": "p", "price_per_gpu_hour": 0.0},
                                           {"name": "d", "instances": [{"gpu": "a", "price_per_gpu_hour": 0.0}]}]}}}
    now = {"base": {"cluster": {"pools": [{"name": "p"}, {"name": "d", "instances": [{"gpu": "a"}]}]}}}
    assert comparable_identity(then) == comparable_identity(now)
    priced = {"base": {"cluster": {"pools": [{"name": "p", "price_per_gpu_hour": 2.5}]}}}
    assert comparable_identity(priced) != comparable_identity({"base": {"cluster": {"pools": [{"name": "p"}]}}})
