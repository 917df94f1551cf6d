"""`dmt explore` in a real browser: the real server on a free port, Debian's headless Chromium driven by Selenium.

One server and one browser serve the whole module. A screenshot of the page is written under the test's temp dir
(the path is printed) for a person to look at.
"""

import io
import json
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest

from toolkit.cli.main import main

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
GiB = 2**30
if not (CHROMIUM and CHROMEDRIVER):
    if os.environ.get("CI"):  # .ci/run installs them: missing there is a failure, not a skip
        raise RuntimeError("chromium and chromium-driver are needed (Debian packages; .ci/run installs them)")
    pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

pytestmark = pytest.mark.launch


@pytest.fixture(scope="module")
def server():
    process = subprocess.Popen([sys.executable, "-m", "toolkit", "explore", "--port", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if not line.startswith("dmt explore: serving "):
        process.kill()
        raise AssertionError(f"dmt explore did not start: {line}{process.stderr.read()}")
    yield line.split()[3]
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def page(server, tmp_path_factory):
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not try to download a driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,2000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.get(server)
    settle(driver)
    yield driver
    shot = tmp_path_factory.mktemp("explore-screenshot") / "dmt-explore.png"
    driver.save_screenshot(str(shot))
    print(f"\ndmt explore screenshot: {shot}")
    # bad input answers 400 by contract; anything else (a JavaScript error, a missing asset, a 500) is a failure
    errors = [entry for entry in driver.get_log("browser")
              if entry["level"] == "SEVERE" and "status of 400 (Bad Request)" not in entry["message"]]
    driver.quit()
    assert not errors, errors


def settle(driver, timeout=30):
    """Wait until no change is scheduled and no request is in flight. No sleep first: the page counts a change as
    scheduled in the input event's own handler (app.js `window.explorer.scheduled`), which WebDriver has run before
    its call returns, so `busy()` is already true for it here."""
    WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        lambda d: d.execute_script("return window.explorer !== undefined && !window.explorer.busy()"))


def set_field(driver, key, value):
    control = driver.find_element(By.CSS_SELECTOR, f'#estimate-form [data-control="{key}"]')
    if control.tag_name == "select":
        Select(control).select_by_value(str(value))
    else:
        control.clear()
        control.send_keys(str(value))
    settle(driver)


def cli_verb(verb, *argv):
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([verb, *argv, "--json"]) == 0
    return json.loads(out.getvalue())


def cli_json(*argv):
    return cli_verb("estimate", *argv)


def bars(driver) -> dict:
    """The bytes behind each stacked bar of the memory chart, and its GiB as drawn."""
    return driver.execute_script(
        "const chart = Chart.getChart('memory-chart');"
        "return Object.fromEntries(chart.data.datasets.map(d => [d.label, [d.bytes[0], d.data[0]]]));")


def test_bars_equal_dmt_estimate_json_as_model_and_zero_change(page):
    Select(page.find_element(By.ID, "model-select")).select_by_value("llama-3.2-3b")
    settle(page)
    for zero in ("3", "0"):
        set_field(page, "zero", zero)
        expected = cli_json("--model", "llama-3.2-3b", "--gpus", "8", "--zero", zero)
        drawn = bars(page)
        for key in ("weights", "gradients", "optimizer", "activations", "overhead"):
            assert drawn[key][0] == expected["memory_bytes"][key]
            assert drawn[key][1] == pytest.approx(expected["memory_bytes"][key] / GiB)
        total = page.find_element(By.CSS_SELECTOR, '#breakdown tr[data-component="total"] td[data-bytes]')
        assert int(total.get_attribute("data-bytes")) == expected["memory_bytes"]["total"]
        explained = page.find_elements(By.CSS_SELECTOR, "#explain-table tbody tr")
        assert {row.get_attribute("data-component") for row in explained} >= {"weights", "optimizer", "activations"}
    # a token budget: goodput, interruptions and the checkpoint interval beside the training days (issue 25)
    set_field(page, "train_tokens", "1T")
    timed = cli_json("--model", "llama-3.2-3b", "--gpus", "8", "--zero", "0", "--train-tokens", "1T")["training_time"]
    assert f"goodput {timed['goodput'] * 100:.1f}%" in page.find_element(By.ID, "goodput").text
    assert f"every {timed['checkpoint']['interval_steps']:,} steps" in page.find_element(By.ID, "goodput").text
    assert "with failures" in page.find_element(By.ID, "training-time").text
    set_field(page, "train_tokens", "")


def test_a_plan_that_stops_fitting_changes_the_verdict(page):
    set_field(page, "zero", "1")
    verdict = page.find_element(By.ID, "verdict")
    assert verdict.get_attribute("data-fits") == "true" and verdict.text.startswith("fits")
    set_field(page, "seq_len", "65536")
    assert verdict.get_attribute("data-fits") == "false"
    assert verdict.text.startswith("does not fit") and "largest: activations" in verdict.text
    assert cli_json("--model", "llama-3.2-3b", "--gpus", "8", "--seq-len", "65536")["fits"] is False
    # the sweep over sequence lengths shows where it stops fitting
    Select(page.find_element(By.ID, "sweep-axis")).select_by_value("seq_len")
    settle(page)
    note = page.find_element(By.ID, "sweep-note")
    # every point answered (a point the server refused is left out, and the miss would be judged across the gap)
    assert "stops fitting at" in note.text and "Not valid" not in note.text, note.text
    first_miss = int(note.get_attribute("data-first-miss"))
    plan = ("--model", "llama-3.2-3b", "--gpus", "8", "--zero", "1")
    assert not cli_json(*plan, "--seq-len", str(first_miss))["fits"], (first_miss, note.text)
    assert cli_json(*plan, "--seq-len", str(first_miss // 2))["fits"], (first_miss, note.text)
    # and, per length, the long-context options of the fastest plan that fits (dmt plan --top 1 at that length)
    rows = page.find_elements(By.CSS_SELECTOR, "#sweep-options tbody tr")
    assert [int(r.get_attribute("data-seq-len")) for r in rows] == page.execute_script("return SWEEPS.seq_len")
    longest_row = rows[-1]
    best = cli_verb("plan", "--model", "llama-3.2-3b", "--gpus", "8", "--zero", "1", "--global-batch",
                    str(page.execute_script("return state.report.plan.global_batch")), "--top", "1", "--seq-len",
                    longest_row.get_attribute("data-seq-len"))["plans"][0]["plan"]
    used = longest_row.get_attribute("data-options").split(",")
    assert used and ("sp" in used) == (best["sp"] > 1) and ("cp" in used) == (best["cp"] > 1)
    assert ("recompute" in used) == (best["recompute"] != "none") and ("tiled_mlp" in used) == best["tiled_mlp"]
    needed = {li.get_attribute("data-option"): int(li.get_attribute("data-from"))
              for li in page.find_elements(By.CSS_SELECTOR, "#sweep-options li")}
    assert set(used) <= set(needed) and all(needed[k] <= int(longest_row.get_attribute("data-seq-len")) for k in used)
    # the --max-seq-len checkbox answers with dmt estimate --max-seq-len's own number, and ranks plans by length
    page.find_element(By.CSS_SELECTOR, '#estimate-form [data-control="max_seq_len"]').click()
    settle(page)
    longest = cli_json("--model", "llama-3.2-3b", "--gpus", "8", "--zero", "1", "--max-seq-len")
    assert int(page.find_element(By.ID, "max-seq-len").get_attribute("data-max-seq-len")) == longest["max_seq_len"]
    assert f"{longest['max_seq_len']:,} tokens" in page.find_element(By.ID, "max-seq-len").text
    ranked = page.find_elements(By.CSS_SELECTOR, "#plan-table tbody tr")
    lengths = [int(r.get_attribute("data-max-seq-len")) for r in ranked]
    assert lengths and lengths == sorted(lengths, reverse=True) and lengths[0] >= longest["max_seq_len"]
    page.find_element(By.CSS_SELECTOR, '#estimate-form [data-control="max_seq_len"]').click()
    settle(page)
    assert page.find_element(By.CSS_SELECTOR, "#plan-table tbody tr").get_attribute("data-max-seq-len") is None
    set_field(page, "seq_len", "4096")
    assert verdict.get_attribute("data-fits") == "true"


def test_a_generated_launch_file_opens_from_the_plan_table(page):
    rows = page.find_elements(By.CSS_SELECTOR, "#plan-table tbody tr")
    assert rows, page.find_element(By.ID, "plan-error").text
    rows[0].find_element(By.CSS_SELECTOR, "button.files").click()
    WebDriverWait(page, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#files-tabs button"))
    tabs = {tab.text: tab for tab in page.find_elements(By.CSS_SELECTOR, "#files-tabs button")}
    assert "slurm.sbatch" in tabs and ("deepspeed.json" in tabs or "megatron.yaml" in tabs)
    tabs["plan.json"].click()
    shown = json.loads(page.find_element(By.ID, "file-text").text)
    best = page.execute_script("return state.plans[0]")
    assert shown["plan"] == best["plan"] and shown["memory_bytes"] == best["memory_bytes"]
    tabs["slurm.sbatch"].click()
    assert page.find_element(By.ID, "file-text").text.startswith("#!/usr/bin/env bash")
    page.find_element(By.ID, "files-close").click()


def test_a_bad_value_shows_the_clis_message_next_to_the_field(page):
    set_field(page, "tp", "7")
    message = page.find_element(By.CSS_SELECTOR, '.field[data-key="tp"] .field-error').text
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        assert main(["estimate", "--model", "llama-3.2-3b", "--gpus", "8", "--tp", "7", "--json"]) == 2
    assert message == err.getvalue().strip()
    assert "invalid" in page.find_element(By.CSS_SELECTOR, '.field[data-key="tp"]').get_attribute("class")
    set_field(page, "tp", "1")  # and the page recovers: the server stayed up
    assert page.find_element(By.CSS_SELECTOR, '.field[data-key="tp"] .field-error').text == ""
    assert page.find_element(By.ID, "verdict").get_attribute("data-fits") == "true"


def test_a_calibration_file_chosen_in_the_page_is_uploaded_and_applied(page, tmp_path):
    """The file input sends the file's text (the server opens no path): the estimate, the plans and the launch files
    use it, and the files include it beside the recipe that names it."""
    import yaml

    from helpers import calibration_data

    path = tmp_path / "h100-calibration.yaml"
    path.write_text(yaml.safe_dump(calibration_data(scale=0.25), sort_keys=False))
    before = page.execute_script("return state.report.step_time_s")
    page.find_element(By.CSS_SELECTOR, '#estimate-form [data-control="calibration"]').send_keys(str(path))
    settle(page)
    report = page.execute_script("return state.report")
    assert report["calibration"]["file"] == "./calibration.yaml"
    assert report["calibration"]["compute_scale"]["hf"] == 0.25 and report["step_time_s"] != before
    assert page.execute_script("return state.plans[0].calibration.compute_scale.hf") == 0.25
    page.find_element(By.CSS_SELECTOR, "#plan-table tbody tr button.files").click()
    WebDriverWait(page, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, '#files-tabs button[data-file="plan.json"]'))
    tabs = {tab.text: tab for tab in page.find_elements(By.CSS_SELECTOR, "#files-tabs button")}
    tabs["calibration.yaml"].click()
    assert yaml.safe_load(page.find_element(By.ID, "file-text").text) == calibration_data(scale=0.25)
    tabs["plan.json"].click()
    assert json.loads(page.find_element(By.ID, "file-text").text)["calibration"]["compute_scale"]["hf"] == 0.25
    page.find_element(By.ID, "files-close").click()
