"""The local Ray cluster `placement="ray"` starts (ray_address=None) is not open to its network
(issue 47): token authentication is on, and every Ray service listens on the loopback address.
It runs in a fresh interpreter: the loopback setting must precede `import ray`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

SCRIPT = r"""
import json, os, subprocess, sys
from ensemble_llm import Ensemble

eng = Ensemble([sys.argv[1]], "single", placement="ray", ray_address=None, member_resources={"num_cpus": 1})
text = eng.generate("Say hi.", max_new_tokens=3).text
import psutil, ray

listening = set()  # (process, address) of every listening socket of the cluster's processes
for p in psutil.Process().children(recursive=True):
    try:
        listening |= {(p.name(), c.laddr.ip) for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    except psutil.Error:
        pass
gcs = ray._private.worker.global_worker.node.gcs_address
probe = (  # a client of the cluster's control service (GCS) with the given token, or the cluster's own
    "import sys\nfrom ray._raylet import GcsClient\n"
    "try:\n    GcsClient(address=sys.argv[1], cluster_id=None).internal_kv_keys(b'', None, timeout=10); print('in')\n"
    "except Exception as e:\n    print('refused', type(e).__name__)\n"
)
joins = {}
for name, token in (("wrong", "0" * 32), ("right", None)):
    env = {**os.environ, **({"RAY_AUTH_TOKEN": token} if token else {})}
    out = subprocess.run([sys.executable, "-c", probe, gcs], env=env, capture_output=True, text=True, timeout=120)
    joins[name] = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-300:]
print("RESULT " + json.dumps({"text": text, "auth": os.environ.get("RAY_AUTH_MODE"), "gcs": gcs,
                             "listening": sorted(listening), "joins": joins}))
"""


def test_the_local_cluster_has_token_auth_and_listens_on_loopback(tiny_dirs, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_dirs["smol"]], capture_output=True, text=True, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT ") :])
    assert isinstance(res["text"], str) and res["auth"] == "token"
    assert res["gcs"].startswith("127.0.0.1:"), res
    assert res["listening"], res  # (the check below must see the cluster's sockets)
    exposed = [(name, ip) for name, ip in res["listening"] if ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert not exposed, exposed
    assert res["joins"] == {"wrong": "refused AuthenticationError", "right": "in"}, res["joins"]
