"""A deploy that takes longer than any controller call may, end to end (#37): ``thaw serve`` with
its repository uploads capped (``--repository-upload-mb-s``), so a 49 MB checkpoint takes over
30 s to deploy -- past the 30 s call bound that used to fail such a deploy. ``thaw deploy
--upload`` sends the directory from the caller's side through the admin API, follows the deploy
with a progress bar and succeeds, and the model serves.

Before that, the same deploy is cut short by SIGKILL of the controller's process while it uploads:
``thaw deploy`` says the deploy was lost and to run it again, nothing of it is visible (no
model listed, no manifest in the repository), and running it again works.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.infra.running_platform import DEADLINE_S, THAW, start_platform, wait_for
from tests.infra.test_chaos import kill_controller
from worker import DemoModelConfig, write_demo_model

pytestmark = pytest.mark.slow

MODEL = "acme/big"
UPLOAD_MB_S = 1.5
OLD_CALL_BOUND_S = 30.0  # ControllerClient's call timeout, which bounded a whole deploy before #37


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy-e2e")
    model_dir = write_demo_model(root / "big", DemoModelConfig(
        hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1376,
        seed=3))
    with start_platform(root, model_dir, "--num-cpus", "2", "--no-calibrate", "--ssd-capacity-gb", "1",
                        "--dram-capacity-gb", "0.25", "--repository-upload-mb-s", str(UPLOAD_MB_S),
                        prefix="dj", demo=False) as running:
        yield running


def deploys(platform) -> list[dict]:
    result = platform.thaw("deploys", "--json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else []


def uploading(platform) -> dict | None:
    return next((d for d in deploys(platform) if d["model_id"] == MODEL and d["stage"] == "uploading"
                 and d["num_bytes_done"] > 0), None)


def test_a_deploy_cut_short_by_a_killed_controller_leaves_nothing_and_says_run_it_again(platform):
    command = [THAW, "deploy", "--name", MODEL, "--source", str(platform.model_dir), "--state", str(platform.state_dir)]
    cli = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=platform.env)
    try:
        running = wait_for(lambda: uploading(platform), "the deploy to be uploading")
        assert running["state"] == "running" and running["num_bytes_total"] > 45_000_000
        status = platform.thaw("status").stdout
        assert "DEPLOYS IN PROGRESS" in status and MODEL in status and "uploading" in status
        kill_controller(platform)
        _, stderr = cli.communicate(timeout=DEADLINE_S * 2)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 1, stderr
    assert "it was restarted while deploying acme/big" in stderr and "run it again" in stderr
    assert wait_for(lambda: platform.thaw("list", "--json", check=False).returncode == 0, "the controller back")
    assert json.loads(platform.thaw("list", "--json").stdout) == []
    manifests = platform.state_dir / "repository" / "_manifests"
    assert not manifests.exists() or list(manifests.iterdir()) == []


def test_a_deploy_uploaded_from_the_callers_side_and_longer_than_the_old_call_bound_serves(platform):
    start = time.monotonic()
    result = subprocess.run([THAW, "deploy", "--name", MODEL, "--source", str(platform.model_dir), "--min-instances",
                             "0", "--upload", "--state", str(platform.state_dir)], capture_output=True, text=True,
                            timeout=DEADLINE_S * 3, env=platform.env)
    elapsed_s = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    assert elapsed_s > OLD_CALL_BOUND_S  # paced by the cap: ~49 MB at 1.5 MB/s
    assert "sending 5 files to the platform" in result.stderr and "sending: 100%" in result.stderr
    assert "uploading: 100%" in result.stderr and f"{MODEL} deployed in" in result.stderr  # (converting: < 1 s)
    assert list((platform.state_dir / "uploads").iterdir()) == []  # deployed: the upload is gone
    done = [d for d in deploys(platform) if d["model_id"] == MODEL and d["state"] == "succeeded"]
    assert done and done[-1]["finished_s"] - done[-1]["started_s"] > OLD_CALL_BOUND_S
    reply = platform.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens <= 4
