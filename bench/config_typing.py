"""What is typed and made while a 2-pool cluster with per-pool overrides is read from TOML and replayed
(issue #27 item 3): coercions (and how many distinct values), replay configs made, policy Params
built, and str.split/partition calls from policies/ files (a policy parsing its parameters).

The prefill pool runs edf with its own tier_ttft table and max_num_seqs; the decode pool the top
level's tiers policy with its tier list and reserve; 20 requests (tests/helpers_cli.py's small trace).

    .venv/bin/python bench/config_typing.py
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import servelab.common.coerce, servelab.replay.config, servelab.replay.core.engine_config, servelab.replay.cluster.config
from servelab.policies.edf import EdfParams
from servelab.policies.tiers import TiersParams
from servelab.replay.config import ReplayConfig
from helpers_cli import write_small_trace
from servelab.api import replay
from servelab.traces.io import read_trace
log = {"coerced": [], "configs": 0, "params": 0}
for m in (servelab.common.coerce, servelab.replay.config, servelab.replay.core.engine_config, servelab.replay.cluster.config):
    f = m.coerce
    m.coerce = (lambda f: lambda v, k, w: (log["coerced"].append(w), f(v, k, w))[1])(f)
for cls, key in ((ReplayConfig, "configs"), (TiersParams, "params"), (EdfParams, "params")):
    chk = cls.__post_init__
    def g(self, chk=chk, key=key):
        log[key] += 1; chk(self)
    cls.__post_init__ = g
TOML = '''
runner = "linear:base=0.01,prefill_token=0.0001"
num_gpu_blocks = 400
kv_bytes_per_token = 1024
policy = "tiers"
[policy_params]
tiers = "priority,standard,flex"
reserve = "flex=0.25"
[[cluster.pools]]
name = "prefill"
role = "prefill"
replicas = 2
policy = "edf"
max_num_seqs = 32
policy_params = { tier_ttft = "priority=0.5,flex=30", ttft_slo_s = 2 }
[[cluster.pools]]
name = "decode"
role = "decode"
replicas = 2
[[cluster.links]]
from = "prefill"
to = "decode"
bandwidth_gbps = 50.0
'''
tmp = Path(tempfile.mkdtemp())
(tmp / "c.toml").write_text(TOML)
trace = read_trace(write_small_trace(tmp))
config = ReplayConfig.from_toml(tmp / "c.toml")
c = log["coerced"]
print(f"read:   coercions {len(c)} ({len(set(c))} distinct values), configs made {log['configs']}, Params built {log['params']}")
log.update(coerced=[], configs=0, params=0)
splits = []
POL = Path(servelab.policies.edf.__file__).parent
def prof(frame, event, arg):
    if event == "c_call" and getattr(arg, "__name__", "") in ("split", "partition") and Path(frame.f_code.co_filename).parent == POL:
        splits.append(1)
sys.setprofile(prof)
r = replay(trace, config)
sys.setprofile(None)
print(f"replay: coercions {len(log['coerced'])}, configs made {log['configs']}, Params built {log['params']}, "
      f"string splits in policies/ {len(splits)}, finished {r.meta['counts']['finished']}")
