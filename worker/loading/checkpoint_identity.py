"""A checkpoint's identity: one short string that two instances compare before sharing a request.

Live migration moves a request's KV (computed by the source's weights) or its tokens (continued by
the destination's weights). Between instances of two *versions* of a model -- the same name
deployed again with new weights, same shapes and vocabulary -- either would mix weights in one
output. The KV shape and the vocabulary checks cannot see that; this identity does.

What it covers: the files every instance of a checkpoint holds, whether it read the weights from
disk or is being streamed them by a peer (which is handed exactly these files first,
`worker.loading.peer_weights.model_files`): every plain file at the top of the model dir but the weights
(thaw partitions, ``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``) and hidden files (a loader's
verification record is a node's own), each by name, size and a digest of its bytes (whole up to
`MAX_WHOLE_FILE_BYTES`, else `NUM_SAMPLES` windows of `SAMPLE_BYTES` spread over it).

* A thaw checkpoint (`loader.format`), which is what the platform serves (a node store converts a
  Hugging Face dir on its way in): its ``thaw_index.json`` carries an xxh3_64 of every chunk of
  every partition, so the identity covers every weight byte without reading one.
* A Hugging Face dir (a local or test setup): the identity covers its config, tokenizer and shard
  index, not the weights themselves -- two trainings of one architecture with the same files
  beside their weights look alike. Convert it (`loader.convert_checkpoint`) to tell them apart.

Copies of one checkpoint on different nodes or tiers agree (nothing node-specific -- a path, a
file time -- is hashed); a re-push with other weights (or another tokenizer) does not. Computing it
reads the small files only: milliseconds, done once per instance, off the event loop.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from loader import ThawIndex, is_thaw_checkpoint

__all__ = ["MAX_WHOLE_FILE_BYTES", "NUM_SAMPLES", "SAMPLE_BYTES", "WEIGHT_SUFFIXES", "checkpoint_identity"]

WEIGHT_SUFFIXES = (".bin", ".safetensors", ".pt", ".pth")  # what a peer's stream carries, not its files

MAX_WHOLE_FILE_BYTES = 64 << 20  # config, tokenizer, a thaw index: read whole
SAMPLE_BYTES = 64 << 10
NUM_SAMPLES = 16  # windows of a larger file: its first, its last, and evenly spaced between


def checkpoint_identity(model_dir: str | Path) -> str:
    """The identity of the checkpoint in ``model_dir``: ``"ckpt-"`` and 16 hex digits (see the
    module docstring). Raises `FileNotFoundError` if ``model_dir`` is not a directory."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    partitions: set[str] = set()
    if is_thaw_checkpoint(model_dir):
        partitions = {p.file for p in ThawIndex.read(model_dir).partitions}
    digest = hashlib.blake2b(digest_size=8)
    for path in sorted(model_dir.iterdir()):
        name = path.name
        if name.startswith(".") or name in partitions or name.endswith(WEIGHT_SUFFIXES) or not path.is_file():
            continue
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        digest.update(_file_digest(path, size))
    return f"ckpt-{digest.hexdigest()}"


def _file_digest(path: Path, size: int) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        if size <= MAX_WHOLE_FILE_BYTES:
            digest.update(f.read())
        else:
            last = size - SAMPLE_BYTES
            for i in range(NUM_SAMPLES):
                f.seek(last * i // (NUM_SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.digest()
