"""The first request after the server says ready costs what the later ones do: nothing is left to import on its
way (a module imported at first use is tens of milliseconds on its TTFT, more on a cold disk)."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]

# In a fresh interpreter (this one has imported whatever other tests did): a server over the tiny Llama fixture,
# healthy, then one streamed completion through the standard library's client (no async stack of its own); prints
# the modules that request imported.
PROBE = """
import http.client, json, sys, tempfile, time
from pathlib import Path
from helpers.server import MODEL_NAME, make_engine, model_folder, running_server

def connection():
    return http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)

with tempfile.TemporaryDirectory() as root, running_server(make_engine(model_folder(Path(root)))) as (server, _):
    while True:
        health = connection()
        health.request("GET", "/health")
        if health.getresponse().status == 200:
            break
        time.sleep(0.1)
    before = set(sys.modules)
    stream = connection()
    stream.request("POST", "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2,
                                                          "stream": True}), {"content-type": "application/json"})
    response = stream.getresponse()
    body = response.read().decode()
    print(json.dumps([response.status, body.endswith("data: [DONE]\\n\\n"), sorted(set(sys.modules) - before)]))
"""


def test_the_first_streamed_request_imports_nothing():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=TESTS.parent, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    status, done, imported = json.loads(run.stdout.strip().splitlines()[-1])
    assert (status, done) == (200, True)
    assert imported == []  # e.g. anyio's asyncio backend, which a streamed answer's task group needs
