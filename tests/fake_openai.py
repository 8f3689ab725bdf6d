"""A stand-in for ``vllm serve``'s OpenAI API on 127.0.0.1 (http.server in a thread, as
test_serve_chat_cpu.py fakes it): /health, /v1/models, /metrics and /v1/completions,
streaming or not, with vLLM's answers to bad requests (a 400), and knobs to stall,
fail or change the answer of chosen requests."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class FakeState:
    """What the fake does, and what it saw. Requests are numbered from 1 in the
    order they arrive."""
    model: str = "m"
    max_model_len: int = 4096
    token_delay_s: float = 0.002
    stall_nth: set = field(default_factory=set)  # these requests stall before any token
    stall_s: float = 3.0
    fail_nth: set = field(default_factory=set)  # these get a 500
    long_prompt_tokens: int = 10**9  # prompts this long "prefill" until dead is set
    drift_after_malformed: bool = False  # answers change after a malformed request
    text_suffix: str = ""
    dead: threading.Event = field(default_factory=threading.Event)
    received: int = 0
    running: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _answer_text(state: FakeState, prompt, index: int) -> str:
    """Deterministic in the prompt (and choice index), like greedy decoding."""
    key = len(prompt) if isinstance(prompt, list) else sum(map(ord, prompt))
    return f"answer {key}.{index}{state.text_suffix}"


def _validation_error(state: FakeState, body: dict) -> str | None:
    prompt = body.get("prompt")
    if prompt in ("", []):
        return "The decoder prompt cannot be empty"
    if isinstance(prompt, list) and len(prompt) > state.max_model_len:
        return "prompt longer than max_model_len"
    if body.get("max_tokens", 16) < 1:
        return "max_tokens must be at least 1"
    if body.get("n", 1) > 1 and body.get("temperature", 1.0) == 0:
        return "n > 1 needs temperature > 0"
    return None


class FakeHandler(BaseHTTPRequestHandler):
    """The fake's endpoints; ``state`` is set on a subclass per server (:func:`start`)."""
    state: FakeState

    def _json(self, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.send_response(503 if self.state.dead.is_set() else 200)
            self.end_headers()
        elif self.path == "/v1/models":
            self._json(200, {"data": [{"id": self.state.model,
                                       "max_model_len": self.state.max_model_len}]})
        elif self.path == "/metrics":
            text = f'vllm:num_requests_running{{model_name="m"}} {self.state.running}.0\n'
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text.encode())
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self):
        with self.state.lock:
            self.state.received += 1
            nth = self.state.received
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        try:
            body = json.loads(raw)
        except ValueError:
            if self.state.drift_after_malformed:
                self.state.text_suffix = " (drifted)"
            return self._json(400, {"error": {"message": "JSON decode error"}})
        if nth in self.state.fail_nth:
            return self._json(500, {"error": {"message": "internal error"}})
        error = _validation_error(self.state, body)
        if error:
            return self._json(400, {"error": {"message": error}})
        if len(body["prompt"]) >= self.state.long_prompt_tokens:
            return self._long_prefill()
        if nth in self.state.stall_nth:
            time.sleep(self.state.stall_s)
        if body.get("stream"):
            return self._stream(body)
        self._complete(body)

    def _long_prefill(self):
        with self.state.lock:
            self.state.running += 1
        self.state.dead.wait(30)
        self._json(500, {"error": {"message": "EngineDeadError"}})

    def _complete(self, body: dict) -> None:
        n, tokens = body.get("n", 1), body.get("max_tokens", 16)
        choices = [{"index": i, "text": _answer_text(self.state, body["prompt"], i),
                    "finish_reason": "length",
                    "logprobs": {"token_logprobs": [-0.25] * tokens}
                    if body.get("logprobs") else None} for i in range(n)]
        self._json(200, {"id": "cmpl-1", "object": "text_completion", "choices": choices,
                         "usage": {"prompt_tokens": len(body["prompt"]),
                                   "completion_tokens": tokens * n}})

    def _stream(self, body: dict) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        tokens = body["max_tokens"]
        events = [{"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                  for i in range(tokens)]
        events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                "completion_tokens": tokens}})
        try:
            for event in events:
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
                time.sleep(self.state.token_delay_s)
            self.wfile.write(b"data: [DONE]\n\n")
        except OSError:  # the client hung up
            pass

    def log_message(self, *args):
        pass


def start(state: FakeState) -> ThreadingHTTPServer:
    """The fake, serving from a daemon thread; ``.server_address[1]`` is its port."""
    handler = type("Handler", (FakeHandler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    return server
