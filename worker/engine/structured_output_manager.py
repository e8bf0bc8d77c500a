"""Structured output inside the engine: one grammar engine per model, a matcher per request, masks every step.

`StructuredOutputManager` is the engine's side of structured output (after vLLM v1's manager of the
same name); the grammars themselves are `worker.text.structured_output`'s. It does four things:

- admission (`check`): a request's `GrammarSpec` is compiled into the grammar engine's cache when
  the request arrives, and one that cannot be enforced is refused there with `InvalidRequestError`
  ("structured_output: ..." and what to change), before it is scheduled. Admission runs on worker
  threads (`InstanceWorker` validates off its event loop), so the `GrammarEngine` -- built on the
  first request that needs one, about a second for a 128k-token vocabulary, never for an engine
  that serves no structured request -- is built once under a lock;
- matchers: each structured request's `GrammarMatcher` lives on its `Sequence` (``seq.grammar``),
  made at its first sampling step and brought up to its output tokens every step before its mask
  is computed. Like `TokenCounts` it follows the request's tokens and nothing else, so it never
  travels: a request rebuilt from tokens it already generated (a migration import replaying them,
  a layer hand-off, a snapshot rebuilt from a client's transcript) gets its matcher rebuilt by
  replaying them, and a preempted request keeps its tokens and so its matcher;
- masks (`begin` -> `MaskJob`): the rows that sample this step and have a grammar get their rows of
  an int32 bitmask filled in one batched llguidance call, then `MaskJob.apply` sets their
  disallowed logits to -inf, before the sampler's penalties, temperature and filters (vLLM v1's
  order: the runner applies the grammar bitmask to the logits, then samples), greedy rows too;
- acceptance (`accept`): the sampled token advances the matcher; the matcher says when the output
  is complete (it accepted an end-of-sequence token), which ends the request with reason "stop".

What overlaps with what (``overlap=True``, the engine's `EngineConfig.overlap_structured_output`):
a row's mask depends only on its matcher, which is final once the previous step's tokens were
accepted -- before this step's forward pass starts. So `begin` runs on the engine's thread after
scheduling (replaying any tokens a matcher lacks, normally none), then hands the fill to one helper
thread and returns; the forward pass runs meanwhile on the engine's thread (llguidance computes
masks without the GIL, torch's kernels release it too, and a GPU forward is asynchronous anyway);
`MaskJob.apply`, after the forward and before sampling, joins the helper and masks the logits.
Accepting tokens stays on the engine's thread (microseconds a token). Without overlap the fill runs
inline in `begin`. A step with no structured row makes no job at all: `begin` returns None after
one look at each row's params, and nothing else of this file runs.

A row whose matcher cannot be made, replayed or filled (a library limit hit mid-generation, a
transcript whose tokens the grammar refuses) is named in `MaskJob.failed`; the engine fails that
request alone and samples the others.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from wire import GrammarSpec, InvalidRequestError
from worker.engine.sequence import Sequence
from worker.text.structured_output import (GrammarEngine, GrammarMatcher, StructuredOutputConfig, StructuredOutputError,
                                           apply_token_bitmask)
from worker.text.tokenizer import Tokenizer

__all__ = ["MaskJob", "StructuredOutputManager"]


class MaskJob:
    """One step's grammar masks: for ``seqs`` (the rows that sample, in order), the bitmask rows of
    the structured ones, being filled (on the helper thread) or filled. Made by
    `StructuredOutputManager.begin`."""

    def __init__(self, seqs: list[Sequence], rows: list[int], bitmask: torch.Tensor,
                 failed: dict[int, BaseException], fill: Future | dict[int, BaseException]) -> None:
        """`fill`: the helper thread's fill under way, or the rows a fill done inline could not fill."""
        self.seqs = seqs
        self.rows = rows  # indices into seqs of the structured rows masked; bitmask row j is for rows[j]
        self.bitmask = bitmask  # [len(rows), W] int32, CPU
        self.failed = failed  # index into seqs -> why its mask could not be made
        self._future: Future | None = None
        if isinstance(fill, Future):
            self._future = fill
        else:
            self._drop(fill)

    def wait(self) -> None:
        """Joins the helper thread's fill, if any (a forward pass that raised must still call it, so
        the next step's fill never races this one's)."""
        future, self._future = self._future, None
        if future is None:
            return
        try:
            failed = future.result()
        except Exception as exc:  # noqa: BLE001 - the fill's own failure: every row it covered
            failed = {row: exc for row in self.rows}
        self._drop(failed)

    @torch.inference_mode()  # the runner's logits are inference tensors, changed here in place
    def apply(self, logits: torch.Tensor) -> None:
        """Joins the fill and sets, in place, every logit the grammar disallows to -inf: logits
        [len(seqs), V], row i sampled for ``seqs[i]``. Rows in ``failed`` are left as they are."""
        self.wait()
        every_row = len(self.rows) == logits.shape[0]  # rows are increasing: then they are 0..N-1
        apply_token_bitmask(logits, self.bitmask, None if every_row else self.rows)

    def _drop(self, failed: dict[int, BaseException]) -> None:
        """Takes the rows in `failed` out of the masked rows (their bitmask rows with them)."""
        if not failed:
            return
        keep = [j for j, row in enumerate(self.rows) if row not in failed]
        self.bitmask = self.bitmask[keep] if keep else self.bitmask[:0]
        self.rows = [self.rows[j] for j in keep]
        self.failed.update(failed)


class StructuredOutputManager:
    """The engine's structured output; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer, model_vocab_size: int, *, overlap: bool = True,
                 config: StructuredOutputConfig = StructuredOutputConfig()) -> None:
        self._tokenizer = tokenizer
        self._model_vocab_size = model_vocab_size
        self._config = config
        self._overlap = overlap
        self._lock = threading.Lock()
        self._grammar_engine: GrammarEngine | None = None
        self._unsupported: str | None = None  # why this model cannot have one (found once, kept)
        self._helper: ThreadPoolExecutor | None = None
        self._bitmask: torch.Tensor | None = None  # reused from step to step, grown as needed

    # ---- admission ---------------------------------------------------------------------------

    def check(self, spec: GrammarSpec) -> None:
        """Compiles `spec` (cached); raises `InvalidRequestError` ("structured_output: ...", what to
        change) if this model cannot enforce it. Thread-safe."""
        try:
            self.grammar_engine().compile(spec)
        except ValueError as exc:
            raise InvalidRequestError(f"structured_output: {exc}") from exc

    def grammar_engine(self) -> GrammarEngine:
        """The model's `GrammarEngine`, built on first use (thread-safe); `ValueError` saying why if
        this model's tokenizer cannot have one."""
        engine = self._grammar_engine
        if engine is not None:
            return engine
        with self._lock:
            if self._grammar_engine is None and self._unsupported is None:
                try:
                    self._grammar_engine = GrammarEngine(self._tokenizer, self._model_vocab_size, self._config)
                except ValueError as exc:
                    self._unsupported = str(exc)
            if self._grammar_engine is None:
                raise ValueError(f"this model cannot enforce it ({self._unsupported}); send the request "
                                 "without structured_output")
            return self._grammar_engine

    @property
    def started(self) -> bool:
        """Whether the grammar engine was built (a request needed it)."""
        return self._grammar_engine is not None

    # ---- each step ---------------------------------------------------------------------------

    def begin(self, seqs: Seq[Sequence], *, overlap: bool | None = None) -> MaskJob | None:
        """Starts this step's masks for `seqs`, the rows that sample, in logits order: None if none
        of them has a grammar; else a `MaskJob`, being filled on the helper thread (`overlap`, the
        manager's setting if None) or filled. Engine thread only."""
        structured = [i for i, seq in enumerate(seqs) if seq.params.structured_output is not None]
        if not structured:
            return None
        failed: dict[int, BaseException] = {}
        rows: list[int] = []
        for i in structured:
            try:
                self._catch_up(seqs[i])
                rows.append(i)
            except Exception as exc:  # noqa: BLE001 - this request's grammar alone
                failed[i] = exc
        bitmask = self._bitmask_rows(len(rows)) if rows else torch.empty((0, 1), dtype=torch.int32)
        matchers = [seqs[i].grammar for i in rows]
        if rows and (overlap if overlap is not None else self._overlap):
            fill = self._helper_thread().submit(self._fill, matchers, rows, bitmask)
        else:
            fill = self._fill(matchers, rows, bitmask) if rows else {}
        return MaskJob(list(seqs), rows, bitmask, failed, fill)

    def accept(self, seq: Sequence, token_id: int) -> bool:
        """Advances `seq`'s matcher past its sampled token; returns whether the output is now
        complete. Raises `StructuredOutputError` if the grammar refuses the token (a mask let
        through what it should not have: the request must end)."""
        matcher = seq.grammar
        if matcher is None or matcher.num_tokens != seq.num_output_tokens:
            raise StructuredOutputError(f"request {seq.request_id!r} has no grammar matcher up to its output")
        if not matcher.accept_token(token_id):  # only if the sampler was left no allowed token to pick
            raise StructuredOutputError(f"the sampled token {token_id} does not fit the structured_output here: no "
                                        "allowed token was left (min_tokens holding back the end of a complete "
                                        "output?)")
        return matcher.is_terminated()

    def _catch_up(self, seq: Sequence) -> None:
        """Makes `seq`'s matcher if it has none and replays the output tokens it lacks (tokens
        generated elsewhere, or before a failure); rebuilds it if it is ahead of them."""
        matcher = seq.grammar
        num_output = seq.num_output_tokens
        if matcher is None or matcher.num_tokens > num_output:
            seq.grammar = None
            matcher = self.grammar_engine().matcher(seq.params.structured_output)
        start = seq.num_prompt_tokens + matcher.num_tokens
        for position, token_id in enumerate(seq.token_ids[start:], start=matcher.num_tokens):
            if not matcher.accept_token(token_id):
                raise StructuredOutputError(f"output token {position} (id {token_id}) does not fit the request's "
                                            "structured_output; the request cannot continue under it")
        if matcher.is_terminated():
            raise StructuredOutputError("the output is already complete under its structured_output")
        seq.grammar = matcher

    def _fill(self, matchers: list[GrammarMatcher], rows: list[int], bitmask: torch.Tensor
              ) -> dict[int, BaseException]:
        """Fills bitmask row j for matchers[j] (one batched call; on failure row by row, to find the
        rows at fault). Returns the failed rows (indices into the job's seqs). Runs without the GIL."""
        engine = self._grammar_engine
        try:
            engine.fill_bitmasks(list(zip(matchers, range(len(rows)))), bitmask)
            return {}
        except Exception:  # noqa: BLE001 - find the rows at fault
            failed: dict[int, BaseException] = {}
            for j, (matcher, row) in enumerate(zip(matchers, rows)):
                try:
                    matcher.fill_bitmask(bitmask, j)
                except Exception as exc:  # noqa: BLE001
                    failed[row] = exc
            return failed

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        """The first `num_rows` rows of the reused bitmask (contiguous), grown when too small. Every
        row handed out is overwritten by the fill, so it is never cleared."""
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = self.grammar_engine().allocate_bitmask(max(num_rows, 8))
        return self._bitmask[:num_rows]

    def _helper_thread(self) -> ThreadPoolExecutor:
        """The one helper thread, made on the first overlapped step (it goes with the manager)."""
        if self._helper is None:
            self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return self._helper

    def __repr__(self) -> str:
        return (f"StructuredOutputManager(started={self.started}, overlap={self._overlap}, "
                f"grammar_engine={self._grammar_engine!r})")
