"""Calibration probes: they measure something, clean up after themselves, and a repository that
refuses the probe is reported as unmeasured rather than failing the store."""

from __future__ import annotations

from storage import LocalModelRepository, RepositoryError
from storage.bandwidth_calibration import calibrate_bandwidth, measure_read_bytes_per_s
from tests.storage.conftest import SHM_ROOT


def test_probes_measure_and_clean_up(tmp_path):
    assert measure_read_bytes_per_s(tmp_path, 256 << 10, cold=True) > 0
    assert measure_read_bytes_per_s(tmp_path, 3 * 4096, cold=False) > 0
    assert list(tmp_path.iterdir()) == []


def test_calibration_with_and_without_repository(tmp_path, hf_model_dir, monkeypatch):
    repo = LocalModelRepository(tmp_path / "repo")
    repo.push(hf_model_dir, "tiny")
    (tmp_path / "ssd").mkdir()
    report = calibrate_bandwidth(ssd_dir=tmp_path / "ssd", shm_dir=SHM_ROOT, num_bytes=128 << 10, repository=repo,
                                 repository_bytes=64 << 10, probe_id="node-a")
    assert report.ssd_bytes_per_s > 0 and report.dram_bytes_per_s > 0 and report.repository_bytes_per_s > 0

    def refuse(*args, **kwargs):
        raise RepositoryError("read-only bucket")

    monkeypatch.setattr(repo, "measure_download_bytes_per_s", refuse)
    report = calibrate_bandwidth(ssd_dir=tmp_path / "ssd", shm_dir=None, num_bytes=128 << 10, repository=repo,
                                 repository_bytes=64 << 10, probe_id="node-a")
    assert report.repository_bytes_per_s is None and report.dram_bytes_per_s is None
    assert list((tmp_path / "ssd").iterdir()) == []
