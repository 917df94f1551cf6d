"""`dmt explore --host 0.0.0.0` serves anyone who can reach the port: what they send is data. A calibration is uploaded
content, never a path the server opens; no request names a file; every hostile body is answered 4xx with one JSON
line, never a 500 (Starlette's TestClient raises any server exception, so a bug fails the test with its traceback)."""

import io
import json
import os
import threading
from contextlib import redirect_stderr, redirect_stdout

import pytest
import yaml
from starlette.testclient import TestClient

from helpers import FUZZ_HANG_GUARD_S, calibration_data
from toolkit.cli.main import main
from toolkit.explore.form import options
from toolkit.explore.launch_files import REQUEST_KEYS
from toolkit.explore.server import MAX_BODY_BYTES, MAX_BODY_DEPTH, create_app
from toolkit.spec.plan import Plan

ESTIMATE = {"model": "llama-3.2-1b", "gpus": 8}
PLAN = {"model": "llama-3.2-1b", "gpus": 8, "seq_len": 2048, "global_batch": 16, "top": 1}


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app())


@pytest.fixture(scope="module")
def ranked(client):
    """The best plan of PLAN, as the page sends it to /api/generate."""
    best = client.post("/api/plan", json=PLAN).json()["plans"][0]
    return {"model": PLAN["model"], "gpu": best["gpu"], "plan": best["plan"]}


def calibration_text(**kwargs) -> str:
    return yaml.safe_dump(calibration_data(**kwargs), sort_keys=False)


def cli_json(*argv):
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        assert main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())


def assert_refused(response, status=400, key=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "key"} and "\n" not in body["error"] and "Traceback" not in body["error"]
    if key is not None:
        assert body["key"] == key, body
    return body


# ---- a calibration is content, never a path ----

def test_an_uploaded_calibration_is_applied_like_the_file_on_the_command_line(client, tmp_path):
    path = tmp_path / "h100.yaml"
    path.write_text(calibration_text())
    with_file = cli_json("estimate", "--model", "llama-3.2-1b", "--gpus", "8", "--calibration", str(path))
    uploaded = client.post("/api/estimate", json={**ESTIMATE, "calibration": path.read_text()})
    assert uploaded.status_code == 200, uploaded.text
    answer = uploaded.json()
    assert answer["calibration"]["file"] == "./calibration.yaml"  # the request's temp dir, written as "."
    assert answer == {**with_file, "calibration": {**with_file["calibration"], "file": "./calibration.yaml"}}
    assert answer["step_time_s"] != client.post("/api/estimate", json=ESTIMATE).json()["step_time_s"]
    planned = client.post("/api/plan", json={**PLAN, "calibration": path.read_text()}).json()
    assert planned["plans"][0]["calibration"]["compute_scale"]["hf"] == 0.25
    assert planned["calibration"]["file"] == "./calibration.yaml"


def test_generate_writes_the_uploaded_calibration_beside_the_recipe_that_names_it(client, ranked):
    response = client.post("/api/generate", json={**ranked, "calibration": calibration_text()})
    assert response.status_code == 200, response.text
    files = response.json()["files"]
    assert yaml.safe_load(files["recipe.yaml"])["cluster"]["calibration"] == "calibration.yaml"
    assert yaml.safe_load(files["calibration.yaml"]) == calibration_data()
    assert json.loads(files["plan.json"])["calibration"]["compute_scale"]["hf"] == 0.25
    assert all("dmt-explore-" not in text for text in files.values())


@pytest.mark.parametrize("text, names", [
    (calibration_text(hardware="a100-80gb"), "a100"),  # another GPU's fit: refused, as on the command line
    (calibration_text(scale=float("nan")), "compute_scale"),
    (calibration_text(scale=float("inf")), "compute_scale"),
    ("format: dmt-calibration/1\n1: [unclosed", "not valid YAML"),
    ("{1: 2}", "format"),
    (json.dumps(["a list"]), "list"),
])
def test_a_bad_uploaded_calibration_is_refused_naming_it(client, ranked, text, names):
    for path, body in (("/api/estimate", ESTIMATE), ("/api/generate", ranked)):
        answer = assert_refused(client.post(path, json={**body, "calibration": text}), key="calibration")
        assert names in answer["error"], answer


def test_a_calibration_path_in_the_request_is_never_opened(client, ranked, tmp_path):
    """A real calibration, /etc/passwd, a missing file and a FIFO (opening it would block) get the same answer: the
    caller learns nothing of the server's disk."""
    real = tmp_path / "calibration.yaml"
    real.write_text(calibration_text())
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    paths = [str(real), "/etc/passwd", str(tmp_path / "missing.yaml"), str(fifo)]
    requests = {"/api/estimate": lambda p: {**ESTIMATE, "calibration": p},
                "/api/plan": lambda p: {**PLAN, "calibration": p},
                "/api/generate": lambda p: {**ranked, "calibration": p},
                "/api/generate plan": lambda p: {**ranked, "plan": {**ranked["plan"], "calibration": p}}}
    for endpoint, request in requests.items():
        answers = []
        for path in paths:
            done: list = []
            worker = threading.Thread(target=lambda: done.append(client.post(endpoint.split()[0], json=request(path))))
            worker.start()
            worker.join(timeout=FUZZ_HANG_GUARD_S)
            if worker.is_alive():  # it opened the FIFO: let it go, then fail
                with open(fifo, "w"):
                    pass
                worker.join()
                pytest.fail(f"{endpoint} opened {path}")
            answers.append(assert_refused(done[0], key="plan.calibration" if "plan" in endpoint.split()[1:]
                                          else "calibration"))
        assert all(answer == answers[0] for answer in answers), (endpoint, answers)
        assert not any(path in answers[0]["error"] for path in paths)


def test_no_other_request_key_names_a_file(client, tmp_path):
    """Every option the page can set that is not an upload takes a value, not a file: a path is just text there."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama"}))
    assert_refused(client.post("/api/estimate", json={**ESTIMATE, "model": str(config)}), key="model")
    assert_refused(client.post("/api/estimate", json={**ESTIMATE, "measured_bw": str(config)}), key="measured_bw")
    assert_refused(client.post("/api/plan", json={**PLAN, "plot": str(tmp_path / "plot.png")}), key="plot")
    assert not (tmp_path / "plot.png").exists()


# ---- hostile bodies: 4xx with one line, never 500 ----

HOSTILE_BODIES = {
    "not JSON": b"model=llama",
    "empty": b"",
    "a list": b"[]",
    "null": b"null",
    "a string": b'"llama-3.2-1b"',
    "not UTF-8": b'{"model": "\xff\xfe"}',
    "NaN": b'{"model": "llama-3.2-1b", "gpus": NaN}',
    "Infinity": b'{"model": "llama-3.2-1b", "gpus": -Infinity}',
    "a lone surrogate": b'{"model": "llama-3.2-1b", "gpu": "\\ud800"}',
    "nested 100000 deep": b"[" * 100_000 + b"]" * 100_000,
    "nested past the limit": json.dumps({"model": "x", "gpus": 8, "tp": [[[[[[[[]]]]]]]]})
                                 .replace("[]", "[" * MAX_BODY_DEPTH + "]" * MAX_BODY_DEPTH).encode(),
    "an integer of 5000 digits": b'{"model": "llama-3.2-1b", "gpus": 1' + b"0" * 5000 + b"}",
    "an unknown key": b'{"model": "llama-3.2-1b", "gpus": 8, "output_dir": "/tmp"}',
    "a value read as a flag": b'{"model": "llama-3.2-1b", "gpus": "--help"}',
    "a key given twice": b'{"model": "llama-3.2-1b", "gpus": 8, "gpus": 4096}',
}


@pytest.mark.parametrize("endpoint", ["/api/estimate", "/api/plan", "/api/generate"])
@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_a_hostile_body_is_answered_400_in_one_line(client, endpoint, name):
    assert_refused(client.post(endpoint, content=HOSTILE_BODIES[name]))


@pytest.mark.parametrize("endpoint", ["/api/estimate", "/api/plan", "/api/generate"])
def test_a_body_over_the_limit_is_not_read(client, endpoint):
    huge = b'{"model": "' + b"x" * (10 * 2**20) + b'"}'
    answer = assert_refused(client.post(endpoint, content=huge), status=413)
    assert str(MAX_BODY_BYTES) in answer["error"]

    def chunks():  # no Content-Length: counted as it streams
        yield b'{"model": "'
        for _ in range(20):
            yield b"x" * 2**16
        yield b'"}'

    assert_refused(client.post(endpoint, content=chunks()), status=413)


WRONG_VALUES = [True, 1.5, -1, [], {}, [1, [2]], {"a": {"b": 1}}, "--help", "-1", "\x00", "x" * 10_000, 1e308]


# every option of the estimate, and those of the plan that the estimate lacks (the others run the same code)
OPTIONS = [("estimate", key) for key in options("estimate")] + \
          [("plan", key) for key in options("plan") if key not in options("estimate")]


@pytest.mark.parametrize("verb, key", OPTIONS)
def test_a_wrong_value_on_any_option_is_never_a_500(client, verb, key):
    for value in WRONG_VALUES:
        response = client.post(f"/api/{verb}", json={**{"estimate": ESTIMATE, "plan": PLAN}[verb], key: value})
        assert response.status_code in (200, 400), (value, response.text)
        if response.status_code == 400:
            assert_refused(response)


@pytest.mark.parametrize("key", [*REQUEST_KEYS, *(f"plan.{key}" for key in Plan.model_fields)])
def test_a_wrong_value_on_any_generate_key_is_never_a_500(client, ranked, key):
    for value in WRONG_VALUES:
        request = json.loads(json.dumps(ranked))
        if key.startswith("plan."):
            request["plan"][key[5:]] = value
        else:
            request[key] = value
        response = client.post("/api/generate", json=request)
        assert response.status_code in (200, 400), (value, response.text)
        if response.status_code == 400:
            assert_refused(response)


def test_a_huge_gpus_per_node_does_not_hang_the_planner(client):
    from toolkit.numeric import COUNT_MAX

    response = client.post("/api/plan", json={**PLAN, "gpus_per_node": COUNT_MAX})  # the largest count a flag takes
    assert response.status_code == 200  # promptly: the planner counted the divisors of 8, not up to 2**53
    assert_refused(client.post("/api/plan", json={**PLAN, "gpus_per_node": 10**100}))  # beyond it: refused


def test_a_huge_global_batch_through_a_pipeline_does_not_hang_the_estimate(client):
    response = client.post("/api/estimate", json={**ESTIMATE, "backend": "megatron", "pp": 2, "global_batch": 10**12})
    assert response.status_code == 200  # promptly: the schedule lists the forwards alive, not all 10**12 of them
    assert response.json()["plan"]["grad_accum"] == 10**12 // 4


def test_unknown_routes_and_methods_answer_json(client):
    assert_refused(client.get("/api/estimate"), status=405)
    assert_refused(client.post("/api/nothing", json={}), status=404)
    assert client.get("/static/../server.py").status_code == 404


def test_a_bug_still_answers_500_in_one_line_and_is_logged(client, ranked, monkeypatch, caplog):
    import toolkit.explore.server as server

    def broken(request):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(server, "launch_files", broken)  # the name the /api/generate route calls
    answering = TestClient(create_app(), raise_server_exceptions=False)
    response = answering.post("/api/generate", json=ranked)
    assert response.status_code == 500
    assert response.json() == {"error": "/api/generate: internal error: ZeroDivisionError", "key": None}
    assert any("ZeroDivisionError" in str(record.exc_info) for record in caplog.records)


RANGED = ["failure_rate", "restart_s", "checkpoint_write_bw", "checkpoint_write_s", "gpu_hour_price"]


@pytest.mark.parametrize("verb", ["estimate", "plan"])
@pytest.mark.parametrize("key", RANGED)
def test_a_finite_number_past_a_plausible_range_is_400_naming_it(client, verb, key):
    """With a token budget the failure and checkpoint figures reach Daly's exponentials: 1e300 answered 500 (an
    OverflowError) and 1e-300 a checkpoint written in no time. Each is refused naming its flag."""
    body = {**{"estimate": ESTIMATE, "plan": PLAN}[verb], "train_tokens": "1T"}
    assert client.post(f"/api/{verb}", json=body).status_code == 200
    for value in (1e300, 1e-300, -1e300):
        if value == 1e-300 and key in ("failure_rate", "restart_s"):
            continue  # 0 is in their range: a tiny rate or restart is a plausible one
        error = assert_refused(client.post(f"/api/{verb}", json={**body, key: value}))["error"]
        assert "--" + key.replace("_", "-") in error, error


def test_failures_faster_than_restarts_are_400_not_500(client):
    body = {**ESTIMATE, "gpus": 16384, "train_tokens": "1T", "failure_rate": 1, "restart_s": 600000}
    assert "never completes" in assert_refused(client.post("/api/estimate", json=body))["error"]
