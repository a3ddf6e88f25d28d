"""The engine's config in typed parts (replay/core/config_parts.py), checked once where it is made (a TOML
file, the command line, the API), and a cluster pool's overrides typed once when the file is read:
nothing inside the engine parses or coerces a config again (#27 item 3)."""

from __future__ import annotations

import ast
from dataclasses import fields, replace
from pathlib import Path

import pytest

from servelab.common.errors import ServelabError
from servelab.policies.base import NoParams
from servelab.replay.core import config_parts
from servelab.replay.cluster.config import ClusterConfig
from servelab.replay.config import ReplayConfig, instance_config, pool_config
from servelab.replay.core.config_parts import PART_OF, PARTS, EngineParts
from servelab.replay.core.engine_config import EngineConfig
from servelab.replay.cluster.instances import InstanceType

ROOT = Path(__file__).resolve().parent.parent


def test_every_engine_field_is_in_exactly_one_part_with_its_type_and_default() -> None:
    engine = {f.name: f for f in fields(EngineConfig)}
    in_parts = [name for _, names in PARTS.values() for name in names]
    assert sorted(in_parts) == sorted(engine), "an EngineConfig field missing from (or doubled in) the parts"
    for part, (cls, names) in PARTS.items():
        for f in fields(cls):
            assert (f.type, f.default) == (engine[f.name].type, engine[f.name].default), (part, f.name)


def test_parts_round_trip_and_are_typed() -> None:
    config = EngineConfig(max_num_seqs=64, kv_tiers=["dram:capacity_gb=64"], spec_method="ngram", max_loras=2)
    parts = config.parts()
    assert isinstance(parts, EngineParts)
    assert parts.batching.max_num_seqs == 64 and parts.kv.kv_tiers == ("dram:capacity_gb=64",)
    assert parts.speculative.spec_method == "ngram" and parts.lora.max_loras == 2
    assert EngineConfig.from_parts(parts) == config
    assert EngineConfig.from_parts(EngineParts()) == EngineConfig()


# one bad value per part: (part, TOML line, the field the message must name)
BAD = [
    ("batching", "max_num_seqs = 0", "max_num_seqs"),
    ("kv", "gpu_memory_utilization = 1.5", "gpu_memory_utilization"),
    ("preemption", 'preemption = "evict"', "preemption"),
    ("cluster", "until_s = -1.0", "until_s"),
    ("platform", "queue_cap = 0", "queue_cap"),
    ("client", "retry_jitter = 2.0", "retry_jitter"),
    ("speculative", 'spec_method = "ngram"\nspec_k = 0', "spec_k"),
    ("lora", "max_loras = 2\nmax_cpu_loras = 1", "max_cpu_loras"),
    ("multimodal", "encoder_cache_tokens = -1", "encoder_cache_tokens"),
    ("retention", 'kv_retention = "forever"', "kv_retention"),
]


def test_the_bad_values_cover_every_part() -> None:
    assert sorted(part for part, _, _ in BAD) == sorted(PARTS)


@pytest.mark.parametrize("part, line, field", BAD, ids=[b[0] for b in BAD])
def test_a_bad_value_is_rejected_when_the_file_is_read_naming_field_and_file(tmp_path, part, line, field) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(line + "\n")
    assert PART_OF[field] == part
    with pytest.raises(ServelabError) as err:
        ReplayConfig.from_toml(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and field in message, message
    # the part rejects it by itself: the check is the part's, not the flat view's
    cls, names = PARTS[part]
    import tomllib

    values = {k: v for k, v in tomllib.loads(line).items() if k in names}
    with pytest.raises(ServelabError, match=field):
        cls(**values)


def test_a_bad_value_is_checked_once(tmp_path, monkeypatch) -> None:
    """Reading a flat file builds each part once (no second validation pass inside)."""
    calls = []
    original = config_parts.BatchingPart.__post_init__
    monkeypatch.setattr(config_parts.BatchingPart, "__post_init__", lambda self: (calls.append(1), original(self)))
    path = tmp_path / "ok.toml"
    path.write_text("max_num_seqs = 8\n")
    ReplayConfig.from_toml(path)
    assert len(calls) == 1


CLUSTER = """
max_num_batched_tokens = 2048
[[cluster.pools]]
name = "prefill"
role = "prefill"
replicas = 2
max_num_batched_tokens = "8192"
kv_tiers = "dram:capacity_gb=64"
tp = "2"
policy = "lifo"
[[cluster.pools]]
name = "decode"
role = "decode"
max_num_seqs = 64
enable_prefix_caching = "false"
[[cluster.links]]
from = "prefill"
to = "decode"
"""


def test_pool_overrides_are_typed_when_read_and_round_trip(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(CLUSTER)
    config = ReplayConfig.from_toml(path)
    prefill, decode = config.cluster.pools
    assert dict(prefill.settings) == {"max_num_batched_tokens": 8192, "kv_tiers": ("dram:capacity_gb=64",),
                                      "tp": 2, "policy": "lifo"}
    assert dict(decode.settings) == {"max_num_seqs": 64, "enable_prefix_caching": False}
    assert ClusterConfig.from_dict(config.cluster.to_dict(), str(path)) == config.cluster
    assert ReplayConfig.from_dict(config.to_dict(), str(path)) == config
    flat = pool_config(config, prefill)
    assert (flat.engine.max_num_batched_tokens, flat.engine.kv_tiers, flat.tp, flat.engine.replicas) == \
        (8192, ("dram:capacity_gb=64",), 2, 2)
    assert flat.policy == "lifo" and flat.policy_params == NoParams() and flat.cluster is None
    assert pool_config(config, decode).engine.enable_prefix_caching is False
    typed = instance_config(flat, InstanceType("a100-80gb", num_gpu_blocks=500), 3)
    assert (typed.gpu, typed.engine.num_gpu_blocks, typed.engine.replicas) == ("a100-80gb", 500, 3)


@pytest.mark.parametrize("line, named", [
    ('max_num_batched_tokens = "many"', "cluster.pools[1].max_num_batched_tokens"),
    ("policy_params = 3", "cluster.pools[1].policy_params"),
    ("kv_tiers = [1, 2]", "cluster.pools[1].kv_tiers"),
    ("max_num_batched_tokens = 0", "cluster pool 'decode': max_num_batched_tokens"),  # valid type, bad value: found when read too
    ("max_cpu_loras = 1", "cluster pool 'decode': max_cpu_loras"),  # valid alone, not with the top level's
])
def test_a_bad_pool_override_is_rejected_when_read_naming_pool_field_and_file(tmp_path, line, named) -> None:
    path = tmp_path / "c.toml"
    text = "max_loras = 4\n" + CLUSTER.replace('role = "decode"\n', f'role = "decode"\n{line}\n')
    path.write_text(text)
    with pytest.raises(ServelabError) as err:
        ReplayConfig.from_toml(path)
    assert str(err.value).startswith(str(path)) and named in str(err.value), str(err.value)


def test_pool_config_equals_the_old_round_trip_for_the_examples() -> None:
    """``pool_config`` replaces fields; the old path re-read ``to_dict`` through ``from_dict`` (coercing
    every value again). Same config, every example cluster pool."""
    seen = 0
    for path in sorted((ROOT / "examples").rglob("*.toml")):
        try:
            config = ReplayConfig.from_toml(path)
        except ServelabError:
            continue  # a search spec, not a replay config
        for pool in config.cluster.pools if config.cluster else ():
            data = config.to_dict()
            data.pop("cluster"), data.pop("fail", None)
            data.update({k: dict(v) if isinstance(v, dict) else v for k, v in pool.settings})
            data["replicas"] = pool.replicas if pool.autoscale is None else pool.autoscale.max
            if "policy" in dict(pool.settings) and "policy_params" not in dict(pool.settings):
                data.pop("policy_params", None)
            assert pool_config(config, pool) == ReplayConfig.from_dict(data, "old"), (path, pool.name)
            seen += 1
    assert seen >= 3


# -- nothing inside the engine parses or coerces a config ------------------------------------------

PARSERS = {"coerce", "from_dict", "from_toml", "make_params", "typed_setting", "runner_spec"}
# the edge: where TOML, the command line and specs become typed objects
EDGE = {"replay/config.py", "replay/cluster/config.py", "replay/core/engine_config.py", "replay/cluster/autoscale.py",
        "replay/cluster/instances.py", "replay/core/runner_spec.py"}
# inside the edge files, the functions that build a pool's config from typed values
INSIDE = {"replay/config.py": ("pool_config", "instance_config")}


def parser_calls(path: Path, rel: str, only: tuple[str, ...] | None = None) -> list[int]:
    tree = ast.parse(path.read_text(), rel)
    roots = [tree] if only is None else [n for n in ast.walk(tree)
                                         if isinstance(n, ast.FunctionDef) and n.name in only]
    lines = []
    for root in roots:
        for node in ast.walk(root):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name in PARSERS:
                    lines.append(node.lineno)
    return lines


def test_the_scan_sees_a_coercion(tmp_path) -> None:
    (tmp_path / "a.py").write_text("x = coerce(v, 'int', 'w')\ny = ReplayConfig.from_dict(d)\n")
    assert parser_calls(tmp_path / "a.py", "a.py") == [1, 2]


def test_the_engine_and_the_assembly_coerce_no_config() -> None:
    found = {}
    for path in sorted((ROOT / "replay").rglob("*.py")) + [ROOT / "assembly.py", ROOT / "api.py"]:
        rel = path.relative_to(ROOT).as_posix()
        if rel in EDGE and rel not in INSIDE:
            continue
        lines = parser_calls(path, rel, INSIDE.get(rel))
        if lines:
            found[rel] = lines
    assert not found, f"a config parsed or coerced inside the engine: {found}"


def test_replace_rechecks_a_part() -> None:
    """A variant (what a search makes with dataclasses.replace) is a new config: checked when made."""
    with pytest.raises(ServelabError, match="max_num_seqs"):
        replace(EngineConfig(), max_num_seqs=0)


def test_a_pool_built_directly_takes_typed_overrides_only() -> None:
    from servelab.replay.cluster.config import PoolConfig

    assert dict(PoolConfig("a", settings=(("max_num_seqs", 64), ("tp", 2))).settings) == {"max_num_seqs": 64, "tp": 2}
    with pytest.raises(ServelabError, match=r"cluster pool 'a'.max_num_seqs: '64' is not a typed value \(int\)"):
        PoolConfig("a", settings=(("max_num_seqs", "64"),))
    with pytest.raises(ServelabError, match=r"kv_tiers: \['dram:capacity_gb=1'\] is not a typed value \(tuple\)"):
        PoolConfig("a", settings=(("kv_tiers", ["dram:capacity_gb=1"]),))
    with pytest.raises(ServelabError, match="unknown key 'max_num_seq'"):
        PoolConfig("a", settings=(("max_num_seq", 64),))
