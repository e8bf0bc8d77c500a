"""Incremental detokenization: generated token ids in, text deltas safe to stream out.

Decoding one token at a time is wrong in two ways, and this file fixes both:

1. A byte-level token may hold only part of a UTF-8 character (emoji and CJK often span two or
   three tokens); decoded alone it shows as U+FFFD. We hold text back while the decoded tail
   ends in U+FFFD and emit the whole character once its last byte arrives.
2. Some decoders (SentencePiece's Metaspace, Llama 2 style) drop the leading space of the first
   token they decode, so decoding a lone "▁world" gives "world". We always decode a window that
   starts a few tokens earlier (at first, the end of the prompt) and emit only what the newest
   tokens added to it.

The window is the `prefix_offset` / `read_offset` technique of vLLM's detokenizer (written
afresh here): `tokens[prefix_offset:read_offset]` is context already emitted,
`tokens[read_offset:]` is not yet emitted; when the decoded window is clean, the offsets move
forward and the emitted tokens become the next context.

On top of that, stop strings: text that could still grow into a stop string is held back, so
a client never sees part of one; when a stop string completes, the output ends right before it.
With several stop strings the one that completes first wins (ties: the longer one), which does
not depend on how the text was split into tokens.

Invariant (tested): the concatenation of all `append` deltas plus `flush()` equals
`tokenizer.decode(generated_ids)`, truncated before the matched stop string if any.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.text.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

# Context tokens taken from the end of the prompt; enough for any decoder's leading-space rule.
_NUM_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Streaming text for one request; see the module docstring."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if isinstance(stop, str):
            raise ValueError("stop must be a sequence of strings, not a single string; wrap it in a list")
        stop = tuple(stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError("every stop string must be a non-empty string")
        self._tokenizer = tokenizer
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self._skip_special_tokens = skip_special_tokens

        context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        # A prompt that ends inside a multi-byte character would glue its bytes onto the first
        # generated token; without context the generated text decodes exactly as on its own.
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []
        self._token_ids: list[int] = context  # context tokens, then generated ones
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)  # decode(tokens[prefix_offset:read_offset])

        self._text = ""  # decoded generated text so far: emitted, then held back for stop strings
        self._num_emitted_chars = 0
        self._stopped = False
        self._matched_stop: str | None = None
        self._flushed = False

    # ---- public API --------------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        """True once a stop string appeared; the output ends right before it."""
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        return self._matched_stop

    @property
    def output_text(self) -> str:
        """All text decoded so far (emitted and held back), truncated before a matched stop string.

        Bytes of an incomplete character are not included until `flush()`.
        """
        return self._text

    @property
    def num_generated_tokens(self) -> int:
        return len(self._token_ids) - self._num_context

    def append(self, token_id: int) -> str:
        """Adds one generated token; returns the text that is safe to emit now (possibly "")."""
        if self._flushed:
            raise RuntimeError("append() after flush(): the request is finished")
        self._token_ids.append(token_id)
        if self._stopped:
            return ""
        new_text = self._decode_pending(final=False)
        return self._emit(new_text, final=False)

    def flush(self) -> str:
        """Ends the request: returns everything still held back (incomplete bytes, stop prefixes)."""
        if self._flushed or self._stopped:
            self._flushed = True
            return ""
        self._flushed = True
        return self._emit(self._decode_pending(final=True), final=True)

    def __repr__(self) -> str:
        return (
            f"IncrementalDetokenizer(num_generated_tokens={self.num_generated_tokens}, "
            f"num_stop_strings={len(self._stop)}, stopped={self._stopped})"
        )

    # ---- decoding ----------------------------------------------------------------------------

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_pending(self, final: bool) -> str:
        """Text of tokens[read_offset:], or "" while it ends in an incomplete character."""
        window_text = self._decode(self._token_ids[self._prefix_offset :])
        if not final and window_text.endswith(_REPLACEMENT_CHAR):
            return ""  # wait for the rest of the character
        if len(window_text) <= len(self._prefix_text):
            # Nothing visible yet (e.g. a skipped special token); keep the window as it is.
            return ""
        new_text = window_text[len(self._prefix_text) :]
        # Move the window: what was just decoded becomes the context for the next token.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        return new_text

    # ---- stop strings ------------------------------------------------------------------------

    def _emit(self, new_text: str, final: bool) -> str:
        if not new_text and not final:
            return ""
        old_len = len(self._text)
        self._text += new_text
        if self._stop:
            stop_at = self._find_stop(old_len)
            if stop_at is not None:
                self._text = self._text[:stop_at]
                self._stopped = True
            elif not final:
                safe_end = max(len(self._text) - self._stop_prefix_len(), self._num_emitted_chars)
                return self._take(safe_end)
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        delta = self._text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta

    def _find_stop(self, old_len: int) -> int | None:
        """Start of the first-completing stop string that ends after old_len, if any."""
        search_from = max(0, old_len - self._max_stop_len + 1)
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self._stop:
            start = self._text.find(s, search_from)
            if start < 0:
                continue
            key = (start + len(s), -len(s), s)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        end, neg_len, s = best
        self._matched_stop = s
        return end + neg_len

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:k]):
                    longest = k
                    break
        return longest
