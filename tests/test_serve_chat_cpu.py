"""The serving check's abort harness against a stand-in HTTP server: clients that
hang up are counted as such, answered ones are not, and the server log's abort
lines are counted once per request."""
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import check_serve_chat as serve_chat  # noqa: E402

COMPLETION = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
              "choices": [{"index": 0, "text": "a", "finish_reason": "length",
                           "logprobs": None}]}


def _server(delay_s: float):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert len(body["prompt"]) == serve_chat.ABORTED_PROMPT_TOKENS
            threading.Event().wait(delay_s)  # a prefill still running when the client gives up
            data = json.dumps(COMPLETION).encode()
            try:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client hung up
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("delay_s,hung_up", [(1.0, serve_chat.ABORTED_PROMPTS), (0.0, 0)])
def test_clients_hang_up_while_the_server_is_still_working(monkeypatch, delay_s, hung_up):
    monkeypatch.setattr(serve_chat.time, "sleep", lambda s: None)  # the wait for aborts
    server = _server(delay_s)
    try:
        assert serve_chat._hang_up_mid_prefill(server.server_address[1], "m") == hung_up
    finally:
        server.shutdown()


def test_aborts_in_the_log_count_each_request_once(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("(APIServer pid=1) INFO [async_llm.py:721] Aborted request(s) cmpl-a-0.\n"
                   "(APIServer pid=1) INFO [async_llm.py:595] Request cmpl-a aborted.\n"
                   "(APIServer pid=1) INFO [async_llm.py:595] Request cmpl-b aborted.\n"
                   "(APIServer pid=1) INFO Received request cmpl-c: prompt ...\n")
    assert serve_chat._aborts_in_log(str(log)) == 2


def test_the_run_fails_when_any_check_fails():
    """The exit status (and so the GPU stage's) follows every check, the abort one too;
    a run that errored records False or nothing, and fails."""
    result = {k: True for k in serve_chat.CHECKS}
    assert serve_chat.all_checks_pass(result)
    for k in serve_chat.CHECKS:
        assert not serve_chat.all_checks_pass({**result, k: False})
    assert not serve_chat.all_checks_pass({})


def _answer(text="5", dcp=1, tokens=("5",), top=None, **kw):
    return {"text": text, "dcp": dcp, "token_logprobs": [-0.5, -0.25],
            "tokens": list(tokens), "top_logprobs": top or [{t: -0.1} for t in tokens],
            "bad_request_status": 400, "text_after_bad_request": text,
            "clients_hung_up": serve_chat.ABORTED_PROMPTS,
            "aborted_in_log": serve_chat.ABORTED_PROMPTS, "text_after_abort": text, **kw}


def test_every_server_is_held_to_the_first_servers_answer():
    assert serve_chat.LAYOUTS[0] == "pcp1" and "pcp2-dcp2-split-all" in serve_chat.LAYOUTS
    same = serve_chat.judge([_answer(), _answer(token_logprobs=[-0.5, -0.125]),
                             _answer(dcp=2)])
    assert serve_chat.all_checks_pass(same) and same["max_abs_logprob_diff"] == 0.125
    assert serve_chat.judge([_answer(), _answer("6"), _answer()])["same_text"] is False
    late = serve_chat.judge([_answer(), _answer(text_after_abort="x"), _answer()])
    assert late["serves_after_abort_mid_prefill"] is False
    assert not serve_chat.all_checks_pass(serve_chat.judge([_answer(), {"error": "x"}]))


def test_a_sharded_cache_is_held_to_the_top5_rule_not_the_text():
    base = _answer("a b", tokens=("a", "b"), top=[{"a": -0.1}, {"b": -0.2, "c": -0.3}])
    near_tie = _answer("a c", dcp=2, tokens=("a", "c"), top=[{"a": -0.1}, {"c": -0.2, "b": -0.21}])
    far = _answer("a d", dcp=2, tokens=("a", "d"), top=[{"a": -0.1}, {"d": -0.2}])
    tie = serve_chat.judge([base, near_tie])
    assert tie["same_text"] and tie["sharded_cache_top5_rule"] is True
    assert serve_chat.judge([base, far])["sharded_cache_top5_rule"] is False
    unrecorded = {k: v for k, v in near_tie.items() if k != "top_logprobs"}
    assert serve_chat.judge([base, unrecorded])["sharded_cache_top5_rule"] is None
    assert serve_chat.judge([base, _answer("b a")])["same_text"] is False  # dcp 1: the text
