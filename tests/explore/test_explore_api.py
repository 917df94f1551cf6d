"""`dmt explore`'s JSON API: the same JSON as `dmt estimate/plan --json`, the CLI's one line on bad input, request keys
and form fields read off the CLI parsers, launch files from the toolkit's generator, nothing read outside a temp dir."""

import io
import json
import socket
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
import yaml
from starlette.testclient import TestClient

from helpers import tiny_llama_config
from toolkit.cli.main import main
from toolkit.explore.form import UPLOADS, form_fields, options, verb_parser
from toolkit.explore.server import create_app


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app())


def cli(verb, *argv):
    """(exit code, stdout, stderr) of `dmt <verb> ...`."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([verb, *argv])
    return code, out.getvalue(), err.getvalue().strip()


def test_estimate_answers_exactly_what_the_cli_prints(client):
    response = client.post("/api/estimate", json={"model": "llama-3.1-8b", "gpus": 8, "zero": 3, "train_tokens": "1T"})
    assert response.status_code == 200
    code, out, _ = cli("estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--zero", "3", "--train-tokens", "1T",
                       "--json")
    assert code == 0 and response.json() == json.loads(out)


def test_plan_answers_exactly_what_the_cli_prints(client):
    request = {"model": "llama-3.1-8b", "gpus": 16, "seq_len": 4096, "global_batch": 128, "top": 4}
    response = client.post("/api/plan", json=request)
    code, out, _ = cli("plan", "--model", "llama-3.1-8b", "--gpus", "16", "--seq-len", "4096", "--global-batch", "128",
                       "--top", "4", "--json")
    assert response.status_code == 200 and code == 0 and response.json() == json.loads(out)
    # 128K tokens: even FSDP2 with CPU offload keeps too many activations of 405B on one GPU
    none_fit = client.post("/api/plan", json={**request, "model": "llama-3.1-405b", "gpus": 1, "seq_len": 131072})
    assert none_fit.status_code == 200 and none_fit.json()["plans"] == [] and none_fit.json()["rejected"]


def test_max_seq_len_answers_what_the_cli_prints_for_estimate_and_plan(client):
    """The form's --max-seq-len checkbox asks the verbs' own search (planner/max_seq_len.py), not a copy of it."""
    estimate = client.post("/api/estimate", json={"model": "llama-3.2-3b", "gpus": 8, "zero": 3, "max_seq_len": True})
    code, out, _ = cli("estimate", "--model", "llama-3.2-3b", "--gpus", "8", "--zero", "3", "--max-seq-len", "--json")
    assert estimate.status_code == 200 and code == 0 and estimate.json() == json.loads(out)
    assert estimate.json()["max_seq_len"] > 0 and estimate.json()["limit"]["seq_len"] > estimate.json()["max_seq_len"]
    request = {"model": "llama-3.2-3b", "gpus": 8, "global_batch": 8, "backend": "fsdp", "top": 3, "max_seq_len": True}
    plan = client.post("/api/plan", json=request)
    code, out, _ = cli("plan", "--model", "llama-3.2-3b", "--gpus", "8", "--global-batch", "8", "--backend", "fsdp",
                       "--top", "3", "--max-seq-len", "--json")
    assert plan.status_code == 200 and code == 0 and plan.json() == json.loads(out)
    lengths = [p["max_seq_len"] for p in plan.json()["plans"]]
    assert len(lengths) == 3 and lengths == sorted(lengths, reverse=True) and lengths[0] > estimate.json()["max_seq_len"]
    # with a --seq-len beside it, the CLI's own line, at the seq_len field
    both = client.post("/api/estimate", json={"model": "llama-3.2-3b", "gpus": 8, "seq_len": 4096, "max_seq_len": True})
    assert both.status_code == 400 and both.json()["key"] == "seq_len"


@pytest.mark.parametrize("request_body, argv, key", [
    ({"model": "llama-3.1-8b", "gpus": 8, "tp": 3}, ["--tp", "3"], "tp"),
    ({"model": "llama-3.1-8b", "gpus": "eight"}, None, "gpus"),
    ({"model": "llama-3.1-8b", "gpus": 8, "zero": 5}, ["--zero", "5"], "zero"),
    ({"model": "llama-3.1-8b", "gpus": 8, "train_tokens": "lots"}, ["--train-tokens", "lots"], "train_tokens"),
    ({"model": "llama-3.1-8b"}, None, "gpus"),
])
def test_bad_input_is_400_with_the_clis_one_line(client, request_body, argv, key):
    response = client.post("/api/estimate", json=request_body)
    assert response.status_code == 400
    body = response.json()
    assert body["key"] == key and "\n" not in body["error"] and "Traceback" not in body["error"]
    if argv is not None:
        code, _, err = cli("estimate", "--model", "llama-3.1-8b", "--gpus", "8", *argv, "--json")
        assert code == 2 and body["error"] == err


def test_nothing_outside_a_temp_dir_is_read(client, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_llama_config()))
    for request in ({"model": str(config), "gpus": 2}, {"model": str(tmp_path), "gpus": 2},
                    {"model": "llama-3.1-8b", "gpus": 8, "measured_bw": str(config)},
                    {"model": "llama-3.1-8b", "gpus": 8, "seq_len": 4096, "global_batch": 8, "plot": "x.png"}):
        response = client.post("/api/plan" if "plot" in request else "/api/estimate", json=request)
        assert response.status_code == 400, request
    assert not (tmp_path / "x.png").exists()


def test_a_pasted_config_is_estimated_like_the_file(client, tmp_path):
    (tmp_path / "pasted-config").mkdir()
    (tmp_path / "pasted-config" / "config.json").write_text(json.dumps(tiny_llama_config()))
    code, out, _ = cli("estimate", "--model", str(tmp_path / "pasted-config"), "--gpus", "2", "--seq-len", "256", "--json")
    for pasted in (tiny_llama_config(), json.dumps(tiny_llama_config())):
        response = client.post("/api/estimate", json={"model": pasted, "gpus": 2, "seq_len": 256})
        assert response.status_code == 200 and response.json() == json.loads(out)
    broken = client.post("/api/estimate", json={"model": '{"model_type": ', "gpus": 2})
    assert broken.status_code == 400 and broken.json()["key"] == "model"


def test_a_body_that_is_not_an_object_is_bad_input(client):
    for body in (b"not json", b"[1, 2]"):
        response = client.post("/api/estimate", content=body)
        assert response.status_code == 400 and "error" in response.json()


def test_request_keys_and_fields_follow_the_cli_parsers():
    for verb in ("estimate", "plan"):
        parser = verb_parser(verb)
        flags = {next(s for s in a.option_strings if s.startswith("--"))[2:].replace("-", "_") for a in parser._actions
                 if any(s.startswith("--") for s in a.option_strings)}  # a switch's --no- form is the same key
        file_options = {a.dest for a in parser._actions if a.type is not None and getattr(a.type, "__name__", "")
                        in ("Path", "PosixPath", "path_arg", "output_arg")}
        assert set(options(verb)) == flags - {"help", "json"} - (file_options - set(UPLOADS))
    fields = {f["key"]: f for f in form_fields("estimate")}
    assert fields["calibration"]["kind"] == "file"  # uploaded as content, never named by path
    assert fields["zero"]["kind"] == "select" and fields["zero"]["choices"] == [0, 1, 2, 3]
    assert fields["sequence_parallel"]["kind"] == "checkbox" and fields["tp"]["kind"] == "number"
    assert fields["model"]["required"] and fields["gpus"]["required"]


def test_a_new_flag_becomes_a_field_and_a_request_key(monkeypatch):
    import toolkit.cli.estimate as estimate_cli

    original = estimate_cli.add_arguments

    def with_new_flag(parser):
        original(parser)
        parser.add_argument("--fused-optimizer-step", action="store_true")

    monkeypatch.setattr(estimate_cli, "add_arguments", with_new_flag)
    verb_parser.cache_clear()
    try:
        assert {"key": "fused_optimizer_step", "kind": "checkbox"}.items() <= \
               {f["key"]: f for f in form_fields("estimate")}["fused_optimizer_step"].items()
    finally:
        verb_parser.cache_clear()


@pytest.mark.parametrize("backend, files", [("deepspeed", {"deepspeed.json", "accelerate.yaml", "slurm.sbatch"}),
                                            ("megatron", {"megatron.yaml", "megatron_args.txt", "slurm.sbatch"}),
                                            ("fsdp", {"accelerate.yaml", "trainer_args.json", "slurm.sbatch"})])
def test_generate_renders_the_ranked_plan_with_the_toolkits_generator(client, backend, files):
    ranked = client.post("/api/plan", json={"model": "llama-3.1-8b", "gpus": 16, "seq_len": 4096, "global_batch": 64,
                                            "backend": backend, "top": 1}).json()["plans"][0]
    response = client.post("/api/generate", json={"model": "llama-3.1-8b", "gpu": ranked["gpu"], "plan": ranked["plan"],
                                                  "train_tokens": "1T"})
    assert response.status_code == 200
    rendered = response.json()["files"]
    assert files | {"plan.json", "recipe.yaml"} <= set(rendered)
    # the generator resolved the very plan that was ranked, with the same memory
    plan_json = json.loads(rendered["plan.json"])
    assert plan_json["plan"] == ranked["plan"] and plan_json["memory_bytes"] == ranked["memory_bytes"]
    recipe = yaml.safe_load(rendered["recipe.yaml"])
    assert recipe["training"]["max_steps"] == -(-10**12 // (64 * 4096))
    assert all("dmt-explore-" not in text for text in rendered.values())  # the temp dir is written as "."


def test_generate_refuses_bad_requests_in_one_line(client):
    for body in ({"model": "/etc/hostname", "plan": {}}, {"model": "llama-3.1-8b", "plan": {"tp": 3, "gpus": 8,
                 "seq_len": 4096, "global_batch": 8}}, {"model": "llama-3.1-8b", "plan": {}, "output": "/tmp"}):
        response = client.post("/api/generate", json=body)
        assert response.status_code == 400 and "\n" not in response.json()["error"]


def test_form_lists_presets_by_size_and_the_gpu_catalogue(client):
    setup = client.get("/api/form").json()
    sizes = [p["params"] for p in setup["presets"]]
    assert sizes == sorted(sizes) and "llama-3.1-8b" in {p["name"] for p in setup["presets"]}
    assert "h100-80gb" in {g["name"] for g in setup["gpus"]}
    assert client.get("/").status_code == 200 and "app.js" in client.get("/").text
    assert client.get("/static/vendor/chart-4.6.1.umd.min.js").status_code == 200


def test_bad_explore_flags_exit_2_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, _, err = cli("explore", "--port", str(taken.getsockname()[1]))
        assert code == 2 and "--port" in err and len(err.splitlines()) == 1
    code, _, err = cli("explore", "--model", str(tmp_path / "nothing.yaml"))
    assert code == 2 and "--model" in err and len(err.splitlines()) == 1


@pytest.mark.launch
def test_binding_every_interface_prints_a_warning():
    process = subprocess.Popen([sys.executable, "-m", "toolkit", "explore", "--host", "0.0.0.0", "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline()
        assert url.startswith("dmt explore: serving http://0.0.0.0:")
        assert "warning" in process.stderr.readline()
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_the_key_is_the_errors_own_field_not_a_flag_read_out_of_its_line():
    from toolkit.errors import UserInputError
    from toolkit.explore.bridge import error_payload

    answer = error_payload("plan", UserInputError("--seq-len", "must divide by --tp 2 x --cp 4"))
    assert answer == {"error": "dmt plan: error: --seq-len: must divide by --tp 2 x --cp 4", "key": "seq_len"}
    assert error_payload("plan", UserInputError("plan", "no layout is left; drop --ep"))["key"] == "plan"
