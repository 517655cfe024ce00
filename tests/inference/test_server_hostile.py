"""The inference server against hostile clients: forged log lines, oversized strings, wrong methods, admin requests
without the token, floods of streaming requests. Real server process on the tiny model, raw HTTP."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from server_process import RunningServer, start_server

from primerl.inference.protocol import MAX_NAME_CHARS, printable

MODEL = "tiny"
FORGED = "weights: loaded /tmp/evil as policy version 99"


def _log_lines_after(server: RunningServer, offset: int) -> list[str]:
    return server.log()[offset:].splitlines()


def test_printable_escapes_and_bounds():
    assert printable("a\nb\r\x1b[31mc\u2028") == "a\\nb\\r\\x1b[31mc\\u2028"
    assert printable("x" * 1000, limit=10) == "x" * 10 + "...(+990 chars)"
    assert printable("naïve café") == "naïve café"


@pytest.mark.parametrize("field", ["request_id", "model"])
def test_client_strings_cannot_forge_a_log_line(server: RunningServer, field: str):
    offset = len(server.log())
    body = {"model": MODEL, "token_ids": [1, 2], "sampling_params": {"max_tokens": 2}, field: f"x\n{FORGED}\r\n"}
    response = httpx.post(f"{server.base_url}/inference/v1/generate", json=body, timeout=60)
    assert response.status_code == (200 if field == "request_id" else 404), response.text
    lines = _log_lines_after(server, offset)
    assert lines, "the request left no log line"
    assert not any(FORGED in line and "\\n" not in line for line in lines), lines
    assert any("\\n" + FORGED in line for line in lines), lines


def test_an_oversized_client_string_is_refused_not_echoed(server: RunningServer):
    offset = len(server.log())
    huge = "A" * 5_000_000
    for body in (
        {"model": MODEL, "token_ids": [1], "request_id": huge},
        {"model": huge, "token_ids": [1]},
    ):
        response = httpx.post(f"{server.base_url}/inference/v1/generate", json=body, timeout=60)
        assert response.status_code == 400, response.text[:300]
        assert len(response.content) < 2000
        assert str(MAX_NAME_CHARS) in response.json()["error"]["message"]
    assert len(server.log()) - offset < 5000


@pytest.mark.parametrize("path", ["/tmp/" + "x" * 300, "/tmp/a\u0000b", "relative/../../etc"])
def test_odd_weight_paths_are_a_400(server: RunningServer, path: str):
    """Found by the fuzzer: a path component longer than the filesystem allows made os.stat raise (500)."""
    response = httpx.post(f"{server.base_url}/admin/update_weights", json={"path": path, "step": 1},
                          headers=server.admin_headers())
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "weights_not_found"


def test_a_wrong_method_is_405_with_allow(server: RunningServer):
    response = httpx.get(f"{server.base_url}/v1/chat/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [b"{not json", b"[]", b'{"path": 3}'])
def test_admin_token_is_checked_before_the_body(server: RunningServer, body: bytes):
    response = httpx.post(
        f"{server.base_url}/admin/update_weights", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    with_token = httpx.post(
        f"{server.base_url}/admin/update_weights",
        content=body,
        headers={"Content-Type": "application/json", **server.admin_headers()},
    )
    assert with_token.status_code == 400, with_token.text


def test_openapi_documents_the_statuses_the_routes_answer(server: RunningServer):
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    paths = schema["paths"]
    documented = {path: set(ops["post" if "post" in ops else "get"]["responses"]) for path, ops in paths.items()}
    assert {"200", "400", "404", "405", "429", "503"} <= documented["/v1/chat/completions"]
    assert {"200", "400", "404", "405", "429", "503"} <= documented["/inference/v1/generate"]
    assert {"200", "400", "401", "405"} <= documented["/admin/update_weights"]
    assert {"200", "401", "405"} <= documented["/admin/pause"]
    assert not any("422" in statuses for statuses in documented.values())
    assert "ErrorBody" in schema["components"]["schemas"]


def test_admission_limit_refuses_with_429_and_keeps_serving(tiny_model_dir: Path, tmp_path: Path):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with (
        start_server(tiny_model_dir, tmp_path, "--max-concurrent-requests", "2") as server,
        httpx.Client(base_url=server.base_url, timeout=60) as http,
    ):
        assert http.post("/admin/pause", headers=server.admin_headers()).status_code == 200
        streams = [http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) for _ in range(2)]
        readers = []  # kept open: a closed reader closes its response
        for stream in streams:  # in flight and held by the paused engine once the first event arrived
            response = stream.__enter__()
            assert response.status_code == 200
            readers.append(response.iter_lines())
            assert next(readers[-1]).startswith("data: ")
        refused = http.post("/v1/chat/completions", json=chat)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "too_many_requests"
        assert http.get("/health").status_code == 200  # other routes are not limited
        assert http.post("/admin/resume", headers=server.admin_headers()).status_code == 200
        for stream in streams:
            stream.__exit__(None, None, None)
        # the slots free once the held streams end; wait for that, bounded
        deadline = time.monotonic() + 60
        while (done := http.post("/v1/chat/completions", json=chat)).status_code == 429:
            assert time.monotonic() < deadline, "the admission slots were never released"
        assert done.status_code == 200, done.text
