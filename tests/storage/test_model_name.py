"""Model names: one plain path segment, or a clear refusal."""

import pytest

from storage import InvalidModelNameError, validate_model_name


@pytest.mark.parametrize("name", ["llama-3-8b", "Qwen2.5-0.5B-Instruct", "a", "m_0", "x" * 128, "acme--llama"])
def test_valid_names(name):
    assert validate_model_name(name) == name


@pytest.mark.parametrize("name, message", [
    ("", "must not be empty"),
    ("x" * 129, "129 characters"),
    ("acme/llama", "path separator; use one segment, e.g. 'acme--llama'"),
    ("../etc", "path separator"),
    ("a\\b", "path separator"),
    ("..", "contains '..'"),
    ("a..b", "contains '..'"),
    (".hidden", "must start with a letter or digit"),
    ("_manifests", "must start with a letter or digit"),
    ("-flag", "must start with a letter or digit"),
    ("sp ace", "only letters"),
    ("caf\u00e9", "only letters"),
    (None, "must be a string"),
])
def test_invalid_names(name, message):
    with pytest.raises(InvalidModelNameError, match=message.replace(".", r"\.").replace("(", r"\(")):
        validate_model_name(name)
