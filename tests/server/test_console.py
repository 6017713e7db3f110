"""The web console in a real headless Chromium (Debian's, through its chromedriver),
against ``trio serve`` with API keys on the tiny Llama.

A run is trained a few steps through pytrio over HTTP, logs a ``reward`` each step and
saves a training state and sampler weights; then, in the browser: a wrong key shows the
server's error; the right one lists the user's runs (not another user's); the run shows
its loss and reward curves with one point per step, at the server's values; a checkpoint
downloads (the same bytes as the archive route) and is deleted (a dismissed confirm
deletes nothing); the playground samples from the saved weights. Each stage leaves a
screenshot under the test's tmp_path (paths printed; ``pytest -s`` shows them).
Every wait is a WebDriverWait on a page condition, never a sleep.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

import pytrio as trio

from ..sdk.conftest import ServeProcess

CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMEDRIVER),
    reason=f"no chromedriver at {CHROMEDRIVER}: apt-get install chromium chromium-driver (.ci/run does)")

MODEL = "trio/tiny-llama"
STEPS = 4
WAIT = 120  # seconds a page condition may take (a first sample loads the model)
TOKENS = [1, 17, 300, 42, 9, 77, 5, 1024, 31]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServeProcess(tmp_path_factory.mktemp("console-serve"), "--dtype", "float32")
    srv.key, srv.other_key = srv.create_key(), srv.create_key()
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1200"):
        options.add_argument(arg)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.downloads = downloads
    yield driver
    driver.quit()


def train(server) -> tuple[trio.TrainingClient, str, str]:
    """A run of STEPS steps with a reward logged at each; its state and sampler weights."""
    svc = trio.ServiceClient(base_url=server.url, api_key=server.key)
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=0)
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
    for i in range(STEPS):
        tc.forward_backward([datum])
        tc.optim_step(trio.AdamParams(learning_rate=0.01))
        tc.log_metrics({"reward": 0.25 * i})  # at the step the optim_step just made
    state = tc.save_state("console-state").result().path
    sampler = tc.save_weights_for_sampler("console-sampler").result().path
    # another user's run, which the console must not show
    other = trio.ServiceClient(base_url=server.url, api_key=server.other_key)
    other.create_lora_training_client(base_model=MODEL, rank=2)
    return tc, state, sampler


def test_console_end_to_end(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    tc, state_path, sampler_path = train(server)
    rest = trio.ServiceClient(base_url=server.url, api_key=server.key).create_rest_client()
    steps = rest.get_run_metrics(tc.model_id)
    assert [s.step for s in steps] == list(range(1, STEPS + 1))
    driver, wait = browser, WebDriverWait(browser, WAIT)
    shots: list[Path] = []

    def shot(name: str) -> None:
        path = tmp_path / f"{len(shots) + 1:02d}-{name}.png"
        assert driver.save_screenshot(str(path))
        shots.append(path)
        print(f"screenshot: {path}")

    def css(selector: str) -> list:
        return driver.find_elements(By.CSS_SELECTOR, selector)

    # 1. the page loads without a key; a wrong key shows the server's own error
    driver.get(server.url + "/console")
    key_box = wait.until(ec.visibility_of_element_located((By.ID, "api-key")))
    key_box.send_keys("trio-not-a-key")
    driver.find_element(By.ID, "login").click()
    error = wait.until(ec.visibility_of_element_located((By.ID, "login-error")))
    assert error.text == "invalid API key"
    shot("wrong-key")

    # 2. the right key: the user's runs, and only theirs
    key_box.clear()
    key_box.send_keys(server.key)
    driver.find_element(By.ID, "login").click()
    row = wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, "#runs tbody tr[data-run-id]")))
    assert [r.get_attribute("data-run-id") for r in css("#runs tbody tr")] == [tc.model_id]
    cells = [td.text for td in row.find_elements(By.TAG_NAME, "td")]
    assert cells[:3] == [tc.model_id, MODEL, str(STEPS)] and cells[3]
    assert driver.execute_script("return sessionStorage.getItem('trio.apiKey')") == server.key
    shot("runs")

    # 3. the run: loss and reward curves, one point per step, at the server's values
    row.find_element(By.TAG_NAME, "button").click()
    wait.until(lambda d: d.find_element(By.ID, "run-view").get_attribute("data-loaded") == tc.model_id)
    for metric in ("loss", "reward"):
        points = css(f'svg.chart[data-metric="{metric}"] circle.point')
        assert len(points) == STEPS, metric
        drawn = [(int(p.get_attribute("data-step")), float(p.get_attribute("data-value"))) for p in points]
        assert drawn == [(s.step, pytest.approx(s.metrics[metric], rel=1e-9)) for s in steps], metric
    assert [p[1] for p in drawn] == [0.25 * i for i in range(STEPS)]  # the rewards logged
    shot("run-metrics")

    # 4. checkpoints: human-readable sizes; a download is the archive, byte for byte
    rows = {r.get_attribute("data-path"): r for r in css("#checkpoints tbody tr")}
    assert set(rows) == {state_path, sampler_path}
    for r in rows.values():
        assert re.fullmatch(r"\d+(\.\d)? (B|KiB|MiB|GiB)", r.find_elements(By.TAG_NAME, "td")[2].text)
    rows[state_path].find_element(By.CSS_SELECTOR, "button.download").click()
    tar = driver.downloads / (state_path.removeprefix("trio://").replace("/", "-") + ".tar")
    wait.until(lambda d: tar.exists() and not list(driver.downloads.glob("*.crdownload")))
    archive = httpx.get(server.url + "/api/v1/checkpoints/archive", params={"path": state_path},
                        headers={"Authorization": f"Bearer {server.key}"}, timeout=60)
    assert archive.status_code == 200 and tar.read_bytes() == archive.content
    shot("checkpoints")

    # 5. delete: a dismissed confirm deletes nothing; an accepted one removes it everywhere
    rows[state_path].find_element(By.CSS_SELECTOR, "button.delete").click()
    wait.until(ec.alert_is_present()).dismiss()
    assert state_path in {c.path for c in rest.list_checkpoints(tc.model_id)}
    rows[state_path].find_element(By.CSS_SELECTOR, "button.delete").click()
    alert = wait.until(ec.alert_is_present())
    assert state_path in alert.text
    alert.accept()
    wait.until(ec.staleness_of(rows[state_path]))
    wait.until(lambda d: [r.get_attribute("data-path") for r in css("#checkpoints tbody tr")] == [sampler_path])
    assert [c.path for c in rest.list_checkpoints(tc.model_id)] == [sampler_path]
    shot("deleted")

    # 6. the playground: sample the saved weights through /openai/v1/completions
    driver.find_element(By.ID, "nav-playground").click()
    wait.until(lambda d: d.find_element(By.ID, "pg-model").get_attribute("data-loaded")
               or d.find_element(By.ID, "pg-error").is_displayed())
    models = httpx.get(server.url + "/openai/v1/models", headers={"Authorization": f"Bearer {server.key}"})
    assert models.status_code == 200, models.text
    options = [o.get_attribute("value") for o in css("#pg-model option")]
    assert MODEL in options and sampler_path in options and state_path not in options
    Select(driver.find_element(By.ID, "pg-model")).select_by_value(sampler_path)
    prompt = "Question: what is trio?\nAnswer:"
    driver.find_element(By.ID, "pg-prompt").send_keys(prompt)

    def fill(**fields: str) -> None:
        for field, value in fields.items():
            box = driver.find_element(By.ID, field)
            box.clear()
            box.send_keys(value)

    # a request the server refuses shows the server's OpenAI-shaped error message
    fill(**{"pg-max-tokens": "1000000"})
    driver.find_element(By.ID, "pg-submit").click()
    error = wait.until(ec.visibility_of_element_located((By.ID, "pg-error")))
    refused = httpx.post(server.url + "/openai/v1/completions", headers={"Authorization": f"Bearer {server.key}"},
                         json={"model": sampler_path, "prompt": prompt, "max_tokens": 1000000, "n": 1,
                               "temperature": 1, "top_p": 1}, timeout=60)
    assert refused.status_code == 400 and error.text == refused.json()["error"]["message"]
    shot("playground-refused")

    fill(**{"pg-max-tokens": "8", "pg-n": "2", "pg-temperature": "0.7"})
    driver.find_element(By.ID, "pg-submit").click()
    wait.until(lambda d: len(css("#pg-results li.completion")) == 2 or d.find_element(By.ID, "pg-error").is_displayed())
    assert not driver.find_element(By.ID, "pg-error").is_displayed(), driver.find_element(By.ID, "pg-error").text
    completions = css("#pg-results li.completion")
    assert [c.get_attribute("data-index") for c in completions] == ["0", "1"]
    assert all("finish_reason: " in c.text for c in completions)
    assert "prompt tokens" in driver.find_element(By.ID, "pg-usage").text
    shot("playground")


def test_another_key_in_the_same_tab_sees_nothing_of_the_last_one(server, browser):
    """Log out and in with another key, no reload: the first user's run, checkpoints,
    playground prompt and models are gone; an answer that arrives after the logout (a
    Refresh on its way, held here by wrapping fetch) draws nothing. Also a run whose
    metrics near the largest double draws finite points, and grad_norm is charted."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    svc = trio.ServiceClient(base_url=server.url, api_key=server.key)
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=1)
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={"target_tokens": TOKENS[1:]})
    for value in (1.7e308, -1.7e308):
        tc.forward_backward([datum])
        tc.optim_step()
        tc.log_metrics({"huge": value})
    sampler = tc.save_weights_for_sampler("isolation").result().path
    driver, wait = browser, WebDriverWait(browser, WAIT)

    def css(selector: str) -> list:
        return driver.find_elements(By.CSS_SELECTOR, selector)

    def log_in(key: str) -> None:
        box = wait.until(ec.visibility_of_element_located((By.ID, "api-key")))
        box.clear()
        box.send_keys(key)
        driver.find_element(By.ID, "login").click()
        wait.until(ec.visibility_of_element_located((By.ID, "runs-view")))

    driver.get(server.url + "/console")
    log_in(server.key)
    wait.until(lambda d: css(f'#runs tr[data-run-id="{tc.model_id}"] button'))[0].click()
    wait.until(lambda d: d.find_element(By.ID, "run-view").get_attribute("data-loaded") == tc.model_id)
    assert css('svg.chart[data-metric="grad_norm"]')  # the service's own metrics are charted too
    points = css('svg.chart[data-metric="huge"] circle.point')
    assert len(points) == 2 and all(float(p.get_attribute("cy")) == float(p.get_attribute("cy")) for p in points)
    assert not [e for e in driver.get_log("browser") if "NaN" in e["message"]]
    driver.find_element(By.ID, "nav-playground").click()
    wait.until(lambda d: d.find_element(By.ID, "pg-model").get_attribute("data-loaded"))
    driver.find_element(By.ID, "pg-prompt").send_keys("alice's private prompt")

    driver.find_element(By.ID, "logout").click()
    log_in(server.other_key)
    assert driver.find_element(By.ID, "pg-prompt").get_attribute("value") == ""
    assert not css("#pg-model option") and not css("#checkpoints tbody tr") and not css("#charts figure")
    assert driver.find_element(By.ID, "run-summary").text == ""
    assert tc.model_id not in driver.find_element(By.ID, "runs").text
    driver.find_element(By.ID, "nav-playground").click()
    wait.until(lambda d: d.find_element(By.ID, "pg-model").get_attribute("data-loaded"))
    assert sampler not in [o.get_attribute("value") for o in css("#pg-model option")]

    # a Refresh answered only after the logout
    driver.execute_script("""
        const fetch = window.fetch;
        window.heldOpen = new Promise((resolve) => { window.release = resolve; });
        window.answered = 0;
        window.fetch = async (...args) => {
            await window.heldOpen;
            const response = await fetch(...args);
            const body = response.json.bind(response);
            // counted once the caller's code after its `await ...json()` has run (a task later)
            response.json = async () => { const v = await body(); setTimeout(() => { window.answered += 1; }, 0); return v; };
            return response;
        };
    """)
    driver.find_element(By.ID, "nav-runs").click()
    driver.find_element(By.ID, "logout").click()
    driver.execute_script("window.release()")
    wait.until(lambda d: d.execute_script("return window.answered") >= 1)
    assert driver.find_element(By.ID, "login-view").is_displayed() and not driver.find_element(By.ID, "nav").is_displayed()
    assert not css("#runs tbody tr")
