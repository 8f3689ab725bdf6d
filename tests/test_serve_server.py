"""tests/engine/serve.py's server and clients against a stand-in for ``vllm serve``: up once
healthy, gone after, a dying one fails with its log; hang-ups counted, workers found."""
import contextlib
import sys
import time
from pathlib import Path

import pytest

import serve

# argv: serve MODEL --port P ...: MODEL "die" exits at once; else two titled workers and an
# API whose long prompts (the hang-ups') take a second
STUB = """import json, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
if sys.argv[2] == "die":
    sys.exit("boom: no GPU")
for r in (0, 1):
    subprocess.Popen(["bash", "-c", f"exec -a VLLM::Worker_PCP{r} sleep 60"])
class H(BaseHTTPRequestHandler):
    def do_GET(self, body=b""):
        self.send_response(200)
        self.send_header("Content-Type", "application/json" if body else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):  # a hung-up client's answer fails to go, in its own thread
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(1.0 if len(body["prompt"]) > 1000 else 0)
        self.do_GET(json.dumps({"choices": [{"index": 0, "text": "ok"}]}).encode())
port = int(sys.argv[sys.argv.index("--port") + 1])
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_a_server_is_up_once_healthy_gone_after_or_fails_with_its_log(tmp_path, monkeypatch):
    (tmp_path / "stub.py").write_text(STUB)
    monkeypatch.setattr(serve, "VLLM", [sys.executable, str(tmp_path / "stub.py")])
    monkeypatch.setattr(serve, "ABORT_SETTLE_S", 0.0)
    with serve.serve("pcp2", "m", str(tmp_path / "log"), "--seed", "0") as server:
        assert server.command.startswith("vllm serve m --port ")
        assert "--prefill-context-parallel-size 2" in server.command
        assert serve.greedy(server, "m", "hi") == {"text": "ok"}
        assert serve.hang_up_mid_prefill(server, "m") == serve.ABORTED_PROMPTS
        workers = serve.workers(server.proc.pid)
        assert [title for title, _ in workers] == ["VLLM::Worker_PCP0", "VLLM::Worker_PCP1"]
    assert server.proc.poll() is not None and not serve.healthy(server)
    deadline = time.monotonic() + 5  # SIGKILL lands a moment later
    while any(map(_titled, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_titled, workers))
    with pytest.raises(RuntimeError, match="boom: no GPU"):  # one that dies first: its log
        with serve.serve("pcp1", "die", str(tmp_path / "log")):
            pass


def _titled(worker) -> bool:
    with contextlib.suppress(OSError):
        return "VLLM::" in Path(f"/proc/{worker[1]}/cmdline").read_text()
    return False


def test_the_servers_flags_parse_under_vllm_serves_own_parser():
    """Each flag set test_serve.py starts ``vllm serve`` with, after every layout's flags,
    is taken by the installed vLLM's serve parser (an unknown flag exits it)."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import test_serve
    from layouts import LAYOUTS, serve_flags

    had = current_platform.device_type
    current_platform.device_type = had or "cuda"  # DeviceConfig("auto") needs one
    try:
        parser = make_arg_parser(FlexibleArgumentParser())
        for flags in (test_serve.CHAT_FLAGS, test_serve.FAULT_FLAGS, test_serve.SOAK_FLAGS,
                      test_serve.GSM8K_FLAGS):
            for name in LAYOUTS:
                args = parser.parse_args(["m", "--port", "1", *serve_flags(name), *flags])
                assert args.prefill_context_parallel_size == LAYOUTS[name].pcp
            assert args.enable_flashinfer_autotune is False  # its tuning runs at each start
        with pytest.raises(SystemExit):
            parser.parse_args(["m", "--no-such-flag"])
    finally:
        current_platform.device_type = had
