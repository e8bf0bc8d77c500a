"""NodeStoreConfig: validation with actionable messages, and names that keep platforms apart."""

from pathlib import Path

import pytest

from storage import NodeStoreConfig


def config(**overrides) -> NodeStoreConfig:
    fields = dict(ssd_dir=Path("/var/cache/thaw"), ssd_capacity_bytes=1 << 30)
    fields.update(overrides)
    return NodeStoreConfig(**fields)


def test_defaults_and_shm_naming():
    a, b = config(), config()
    assert a.platform_id != b.platform_id  # random by default: two platforms never collide
    assert a.shm_dir.parent == Path("/dev/shm") and a.shm_dir.name == f"thaw-{a.platform_id}.node0"
    named = config(platform_id="prod", node_id="gpu-7", shm_root="/run/thaw-shm", ssd_dir="/ssd")
    assert named.shm_dir == Path("/run/thaw-shm/thaw-prod.gpu-7") and named.ssd_dir == Path("/ssd")
    # No platform's prefix is another's, even when one id extends the other.
    assert not config(platform_id="prod-eu").shm_dir.name.startswith(named.shm_dir_prefix)


@pytest.mark.parametrize("overrides, message", [
    ({"ssd_dir": "relative/cache"}, "ssd_dir 'relative/cache' must be an absolute path"),
    ({"ssd_dir": ""}, "ssd_dir must be a path"),
    ({"shm_root": "shm"}, "shm_root 'shm' must be an absolute path"),
    ({"ssd_capacity_bytes": 0}, "ssd_capacity_bytes is 0"),
    ({"ssd_capacity_bytes": 1.5}, "ssd_capacity_bytes is 1.5"),
    ({"dram_capacity_bytes": -1}, "dram_capacity_bytes is -1"),
    ({"platform_id": "a.b"}, "platform_id 'a.b' must be"),
    ({"platform_id": ""}, "platform_id '' must be"),
    ({"node_id": "../x"}, "node_id '../x' must be"),
    ({"calibration_bytes": 5000}, "multiple of 4096"),
    ({"calibration_bytes": 0}, "calibration_bytes is 0"),
    ({"repository_calibration_bytes": -1}, "repository_calibration_bytes"),
    ({"convert_dtype": "int8"}, "convert_dtype 'int8'"),
    ({"convert_chunk_bytes": 4097}, "convert_chunk_bytes"),
    ({"copy_threads": 0}, "copy_threads"),
    ({"short_fetch_ratio": 0.5}, "short_fetch_ratio must be 0 \\(arrival order\\) or a number >= 1, got 0.5"),
    ({"short_fetch_ratio": float("inf")}, "short_fetch_ratio must be 0"),
    ({"calibrate": "yes"}, "calibrate must be True or False"),
    ({"ssd_dir": "/dev/shm/thaw-p.n/ssd", "platform_id": "p", "node_id": "n"}, "must not contain each other"),
])
def test_invalid_values_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        config(**overrides)


def test_frozen():
    with pytest.raises(AttributeError):
        config().ssd_capacity_bytes = 1
