import pytest

from tests.model_factory import make_hf_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama checkpoint with the demo tokenizer (built once per session)."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=11)
