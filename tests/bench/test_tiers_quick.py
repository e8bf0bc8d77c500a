"""``bench/tiers.py --quick`` runs and prints one JSON line per tier (so the benchmark never rots).
No timing is asserted, only that the figures are there and consistent -- and that the DRAM tier's
load read none of the checkpoint from a disk, which is what the tier is for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiers_benchmark_quick():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "tiers.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    by_tier = {line["tier"]: line for line in lines}
    assert [line["tier"] for line in lines] == ["repository", "ssd", "dram"]
    for line in lines:
        assert line["bench"] == "tiers" and line["mode"] == "quick"
        assert line["seconds"] > 0 and line["gbps"] > 0 and line["num_bytes"] == lines[0]["num_bytes"]
    # Nothing of the checkpoint comes from a disk (a load that fell back to the SSD copy reads all of
    # it). Not exactly 0: this VM's kernel drops cached pages all the time, so a code page of a
    # library (or a lazily imported module) can be faulted back in during the load (155 KB seen once).
    assert by_tier["dram"]["disk_read_bytes"] < by_tier["dram"]["num_bytes"] // 10
    assert by_tier["dram"]["ratio_to_dram"] == 1.0
    assert by_tier["repository"]["fetch_convert_s"] < by_tier["repository"]["seconds"]
    assert by_tier["ssd"]["warm_seconds"] > 0 and by_tier["dram"]["promote_s"] > 0
