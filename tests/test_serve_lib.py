"""scripts/serve_lib.sh with a stand-in for `vllm serve` (no vLLM, no GPU)."""
import os
import socket
import subprocess

LIB = os.path.join(os.path.dirname(__file__), "..", "scripts", "serve_lib.sh")
HEALTHY = ("import http.server, sys\n"
           "class H(http.server.BaseHTTPRequestHandler):\n"
           "    def do_GET(self):\n"
           "        self.send_response(200 if self.path == '/health' else 404)\n"
           "        self.end_headers()\n"
           "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
           "print('serving', sys.argv[1:], flush=True)\n"
           "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(stub: str, tmp_path, port: int) -> subprocess.CompletedProcess:
    (tmp_path / "stub.py").write_text(stub)
    script = (f". {LIB}\n"
              f"VLLM_CLI=(python3 {tmp_path / 'stub.py'})\n"
              f"serve_until_healthy {port} {tmp_path / 'log'} 30 MODEL --seed 0\n"
              "echo healthy\n")
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)


def test_returns_once_healthy_and_stops_the_server_at_exit(tmp_path):
    port = _free_port()
    res = _run(HEALTHY, tmp_path, port)
    assert res.returncode == 0 and res.stdout.strip() == "healthy"
    with socket.socket() as s:  # the server went with the script
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert "['serve', 'MODEL', '--port'" in (tmp_path / "log").read_text()
    assert "--seed" in (tmp_path / "log").read_text()


def test_a_server_that_dies_fails_the_script_with_its_log(tmp_path):
    res = _run("print('boom: no GPU'); raise SystemExit(3)\n", tmp_path, _free_port())
    assert res.returncode == 1 and "healthy" not in res.stdout
    assert "boom: no GPU" in res.stdout
